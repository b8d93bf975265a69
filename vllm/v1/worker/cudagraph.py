"""CUDA graphs for pure-decode steps: one captured model forward per batch size, replayed for smaller batches,
and the logits + sampler of those steps as a second graph per (size, sampling settings); mixed steps get forward
graphs of their own (below).

A step in which every request has exactly one query token runs as the graph of the smallest captured size
B >= num_reqs; the rows past num_reqs are padding (see input_prep.py) and their outputs are ignored. The model
forward (input ids and positions -> hidden states) is captured at start-up (CudaGraphManager). The LM head and
the sampler are captured on first use (SamplerGraphs): their shapes and branches depend on the batch's sampling
settings (top-k width, logprobs, mask), which only requests reveal; without them a decode step launches ~100
small kernels from Python, several ms of host time per step that the device then waits for.

Invariants:
- Graphs read their inputs from the runner's persistent device buffers and write the hidden states to one
  static output per size; a replay is valid only after those buffers were filled for B rows.
- Capture happens once, after the KV cache is allocated, largest size first into one shared memory pool; each
  size is warmed up eagerly (Triton compilation, cuBLAS workspaces) before it is captured.
- Attention's num_splits is fixed per size (it sets the grid), chosen for max_model_len.
- Sampler graphs come in two sets with separate memory pools, used alternately step after step: a graph's
  static outputs (sampled ids, logprobs, mask tensors) are read by the output copies and the output thread
  after the step was launched, and the engine launches step N+2 only after step N's `get_output()` returned
  (the batch queue is two deep), by which time the output thread has waited for all of step N's copies and
  built every list that reads a static output directly (its mask lists too when they overflow K; deferred mask
  lists read only the host copies), so the set that step N+2 reuses is free.

Mixed steps (prefills and decodes, total tokens != num_reqs) are padded to a fixed shape, T tokens of the
smallest mixed size >= the step's tokens (`resolve_mixed_capture_sizes`: multiples of 256 and the token budget)
and R = max_num_seqs + 1 request rows (input_prep.py: padding requests on the scratch block hold the surplus
tokens, the other surplus rows have zero tokens), and run as one forward graph per T when CUDA graphs are on
(ModelRunner.use_mixed_cuda_graph). A step larger than every size runs
unpadded and eagerly. The logits and the sampler of a mixed step run on the real rows' last tokens: as the
sampler graph of the padded request count (model_runner.py), or eagerly.
- Capture (ModelRunner.capture_model): the mixed sizes first, largest first, each on
  InputBuffers.fill_dummy_mixed(T, R) running ModelRunner._mixed_forward(T) (the model on input_ids[:T],
  positions[:T] under InputBuffers.mixed_metadata(T, R)); then the decode sizes into the same pool, so the pool
  is sized once, by the largest mixed forward. Each mixed graph copies its hidden states into one output
  [largest T, hidden] shared by every size. A mixed graph reads input_ids, positions, slot_mapping [:T],
  query_start_loc [:R+1], seq_lens [:R], block_table [:R] (only the rows of requests with tokens are written
  each step) and the KV cache.
- Memory: Worker.determine_num_blocks keeps ModelRunner.profile_mixed_graph_memory() out of the KV cache (the
  measured activation peak of an eager forward of the largest T, padding only, plus the shared output) besides
  the eager peak of profile_run, which the eager logits and sampler still need; each mixed size's eager warm-up
  memory goes back to the device before its capture. Not covered: workspaces a capture allocates beyond what
  the eager forward measured; warm-ups of sizes above max_model_len when max_model_len < max_num_batched_tokens
  (profile_run's forward is one request of max_model_len tokens; main's eager multi-request steps share that
  gap); no reserve is taken when kv_cache_memory_bytes or num_gpu_blocks_override sets the cache size.
- Graphs in one pool may reuse each other's freed memory: a graph's static output is valid only until another
  graph of the pool replays, which holds because each step consumes its forward's output before the next step's
  forward is launched on the same stream. A decode graph's static output may lie in memory a mixed graph's
  intermediates use: the sampler graph of a mixed step gets its last hidden states copied into it after the
  mixed forward has replayed, on the same stream.
Measured on an H200 (2026-12-03; docs/benchmarks.md, "Decisions"): the CUDA tests of this module and of
tests/v1/worker/test_mixed_cudagraph.py pass (real graphs against eager runners; the memory capture takes against
the reserve); with the sampler graphs of steps with prefills (model_runner.py) the serving A/B gains 3-5% at 256
and 512 streams and ~1% at 1024 in both rounds, offline +3.3% at 512 requests (ABBA); so both are the only
path whenever CUDA graphs are on. Not measured: the capture time and reserve at larger token budgets, finer sizes
than multiples of 256.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

logger = logging.getLogger(__name__)

DEFAULT_CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896,
                         1024]
_NUM_WARMUP_RUNS = 2


def resolve_capture_sizes(sizes: list[int] | None, max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Sorted capture sizes <= min(max_num_seqs, max_num_batched_tokens); with the default list, that cap is
    added so that every decode batch has a graph."""
    cap = min(max_num_seqs, max_num_batched_tokens)
    chosen = {s for s in (sizes if sizes is not None else DEFAULT_CAPTURE_SIZES) if 0 < s <= cap}
    if sizes is None:
        chosen.add(cap)
    return sorted(chosen)


MIXED_SIZE_STEP = 256


def resolve_mixed_capture_sizes(sizes: list[int] | None, max_num_batched_tokens: int, max_model_len: int,
                                max_num_seqs: int | None = None) -> list[int]:
    """Sorted token counts that mixed steps are padded to: by default the multiples of MIXED_SIZE_STEP below
    the step budget, and that budget itself, so that every step has a size. Sizes past the budget are dropped.
    The budget is max_num_batched_tokens, capped at max_num_seqs * max_model_len (a step holds at most
    max_num_seqs requests of at most max_model_len tokens; a larger size could not be filled by the capture's
    padding-only step of max_num_seqs + 1 rows). NOTE: the padding of a step goes to requests of at most
    max_model_len tokens, and a padded step has at most max_num_seqs + 1 rows, so a size step larger than
    max_model_len could leave no row for the padding: sizes are added below each gap larger than max_model_len."""
    budget = max_num_batched_tokens
    if max_num_seqs is not None:
        budget = min(budget, max_num_seqs * max_model_len)
    if sizes is None:
        sizes = list(range(MIXED_SIZE_STEP, budget, MIXED_SIZE_STEP)) + [budget]
    chosen = sorted({s for s in sizes if 0 < s <= budget})
    filled: list[int] = []
    prev = 0
    for s in chosen:
        filled.extend(range(prev + max_model_len, s, max_model_len))
        filled.append(s)
        prev = s
    return filled


def _forward_capture_error_mode() -> str:
    """"thread_local" with several ranks: NCCL's own threads make CUDA calls while a forward's all_reduce is
    captured, which the default "global" mode counts as errors of the capture; "global" (torch's default) at one
    rank."""
    return "thread_local" if get_tensor_model_parallel_world_size() > 1 else "global"


class CudaGraphManager:
    """Model-forward graphs of one kind of step (pure decode: sizes are rows; mixed: sizes are tokens)."""

    def __init__(self, capture_sizes: list[int], kind: str = "decode") -> None:
        self.capture_sizes = sorted(capture_sizes)
        self.kind = kind
        # size -> (graph, static output [size, hidden_size])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None

    def padded_size(self, n: int) -> int | None:
        """The smallest capture size >= n, or None when n is larger than every size."""
        i = bisect.bisect_left(self.capture_sizes, n)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def capture(self, forward: Callable[[int], torch.Tensor], prepare: Callable[[int], None],
                pool: tuple[int, int] | None = None, release_warmup_memory: bool = False) -> None:
        """`prepare(S)` fills the input buffers with a padding-only step of size S; `forward(S)` runs the model
        on the buffers' first S rows (or tokens) and returns the hidden states. `pool` is another manager's pool
        to share (None: a new one). `release_warmup_memory` hands the eager allocator's cached blocks back to the
        device after each size's warm-up, so that the warm-up's activations and the graph pool are never held at
        once (for forwards as large as a full token budget)."""
        self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            prepare(size)
            for _ in range(_NUM_WARMUP_RUNS):
                forward(size)
            torch.cuda.synchronize()
            if release_warmup_memory:
                torch.cuda.empty_cache()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=_forward_capture_error_mode()):
                output = forward(size)
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %s sizes %s", self.kind, self.capture_sizes)

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of `size` on the current buffers; returns its static output [size, hidden]."""
        graph, output = self.graphs[size]
        graph.replay()
        return output


class SamplerGraphs:
    """Logits + sampler of padded decode steps as CUDA graphs, per (set, size, settings key).

    `run(size, key, make_fn)` replays the graph of (next set, size, key). The first time a key is seen, every
    size in `sizes` is captured for both sets at once (a one-time stall of a few seconds), so that a batch
    shrinking or growing through the sizes later never stops to capture. `make_fn(size)` returns a function that
    reads only static device tensors (the forward graph's output of that size, the persistent sampling buffers'
    first `size` rows) and returns the sampler's output, whose tensors are then static too. `capture=False` runs
    `make_fn(size)()` eagerly instead (tests on CPU exercise the padded metadata that way)."""

    def __init__(self, sizes: list[int], capture: bool = True, max_keys: int = 8) -> None:
        self.sizes = sorted(sizes)
        self.capture = capture
        self.max_keys = max_keys
        self.graphs: dict[tuple[int, int, Hashable], tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.keys: set[Hashable] = set()
        # Set when a capture raised: no more captures, graphs of earlier keys keep replaying.
        self.failed = False
        self.pools: list[tuple[int, int]] = [torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()] \
            if capture else []
        self._next_set = 0

    def run(self, size: int, key: Hashable, make_fn: Callable[[int], Callable[[], Any]]) -> Any | None:
        """The outputs of this step's graph, or None when the key cannot be captured (too many keys: the caller
        runs eagerly)."""
        if not self.capture:
            return make_fn(size)()
        if key not in self.keys:
            if self.failed or len(self.keys) >= self.max_keys or size not in self.sizes:
                return None
            try:
                self._capture_all(key, make_fn)
            except RuntimeError:
                # NOTE: with several ranks every rank must take the same path (the sampled ids and the random
                # state stay in step only so), and a rank cannot know another's capture failed: the error ends
                # the step (and the engine) instead of one rank going eager alone.
                if get_tensor_model_parallel_world_size() > 1:
                    raise
                # NOTE: a sampler op that cannot be captured must not take the engine down: from now on the
                # sampler runs eagerly (the forward graphs are unaffected).
                logger.exception("Capturing the sampler CUDA graphs failed; the sampler runs eagerly from now on.")
                self.failed = True
                self.graphs = {k: v for k, v in self.graphs.items() if k[2] in self.keys}
                torch.cuda.synchronize()
                return None
        graph, output = self.graphs[(self._next_set, size, key)]
        self._next_set ^= 1
        graph.replay()
        return output

    def _capture_all(self, key: Hashable, make_fn: Callable[[int], Callable[[], Any]]) -> None:
        start = time.perf_counter()
        for size in reversed(self.sizes):
            fn = make_fn(size)
            # NOTE: one eager run compiles the Triton kernels and sizes the workspaces; it reads whatever the
            # buffers' rows hold (stale rows are valid settings) and its outputs are dropped. Capture checks only
            # this thread's CUDA calls: the output thread keeps copying and waiting meanwhile.
            fn()
            for graph_set in (0, 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pools[graph_set], capture_error_mode="thread_local"):
                    output = fn()
                self.graphs[(graph_set, size, key)] = (graph, output)
        self.keys.add(key)
        logger.info("Captured sampler CUDA graphs for %d sizes x 2 sets in %.1f s (settings %s)", len(self.sizes),
                    time.perf_counter() - start, key)
