"""CUDA graphs for pure-decode steps: one captured model forward per batch size, replayed for smaller batches,
and the logits + sampler of those steps as a second graph per (size, sampling settings).

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
  after the step was launched, and the engine launches step N+2 only after step N's outputs were turned into
  lists (the batch queue is two deep), so the set that step N+2 reuses is free by then.

Mixed steps (prefills and decodes, total tokens != num_reqs) can be padded to a fixed shape, T tokens of the
smallest mixed size >= the step's tokens (`resolve_mixed_capture_sizes`) and R = max_num_seqs + 1 request rows
(input_prep.py: one padding request holds the surplus tokens, the other surplus rows have zero tokens), so that
their forward could be one graph per T. Only the padded eager forward exists (ModelRunner.pad_eager_mixed, for
tests); the logits and the sampler of a mixed step stay eager on the real rows' last tokens.
NOTE (what a GPU session must add to capture mixed steps):
- Capture: a CudaGraphManager over the mixed sizes whose `prepare(T)` is InputBuffers.fill_dummy_mixed(T, R)
  and whose `forward(T)` runs the model on input_ids.gpu[:T], positions.gpu[:T] under
  InputBuffers.mixed_metadata(T, R) (Triton backend only); it must share the decode graphs' pool (capture the
  largest mixed size first, before the decode sizes, so the pool is sized once by the largest forward), and
  `_forward_rows` must replay it for inputs.num_padded_tokens. The graph reads input_ids, positions,
  slot_mapping [:T], query_start_loc [:R+1], seq_lens [:R], block_table [:R] (only the rows of requests with
  tokens are filled each step) and the KV cache; it writes one static hidden-state output [T, hidden].
- Memory: the pool then holds a forward of max_num_batched_tokens tokens (about profile_run's peak activations)
  besides the eager allocator's cache, which still serves mixed steps larger than every size, the logits and
  the sampler; the KV cache sizing must leave room for both (or the eager path must not keep its own cache).
- Measurement: the padded tokens cost real FLOPs (up to one size step, 255 tokens at step 256) and the R rows
  add ~R * num_kv_heads attention programs that exit at once; whether the saved launch overhead beats that must
  be measured per model (mixed steps of long prefills are GPU-bound and gain little; small chunked-prefill
  steps among many decodes gain most). Finer sizes below 256 may be worth it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

import torch

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


def resolve_mixed_capture_sizes(sizes: list[int] | None, max_num_batched_tokens: int, max_model_len: int
                                ) -> list[int]:
    """Sorted token counts that mixed steps are padded to: by default the multiples of MIXED_SIZE_STEP below
    max_num_batched_tokens, and that budget itself, so that every step has a size. Sizes past the budget are
    dropped. NOTE: the padding of a step goes to requests of at most max_model_len tokens, and a padded step
    has at most max_num_seqs + 1 rows, so a size step larger than max_model_len could leave no row for the
    padding: sizes are added below each gap larger than max_model_len."""
    if sizes is None:
        sizes = list(range(MIXED_SIZE_STEP, max_num_batched_tokens, MIXED_SIZE_STEP)) + [max_num_batched_tokens]
    chosen = sorted({s for s in sizes if 0 < s <= max_num_batched_tokens})
    filled: list[int] = []
    prev = 0
    for s in chosen:
        filled.extend(range(prev + max_model_len, s, max_model_len))
        filled.append(s)
        prev = s
    return filled


class CudaGraphManager:
    def __init__(self, capture_sizes: list[int]) -> None:
        self.capture_sizes = sorted(capture_sizes)
        # size -> (graph, static output [size, hidden_size])
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: tuple[int, int] | None = None

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest capture size >= num_reqs, or None when the batch is larger than every size."""
        i = bisect.bisect_left(self.capture_sizes, num_reqs)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else None

    def capture(self, forward: Callable[[int], torch.Tensor], prepare: Callable[[int], None]) -> None:
        """`prepare(B)` fills the input buffers with a padding-only batch of B rows; `forward(B)` runs the model
        on the buffers' first B rows and returns the hidden states."""
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.capture_sizes):
            prepare(size)
            for _ in range(_NUM_WARMUP_RUNS):
                forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = forward(size)
            self.graphs[size] = (graph, output)
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for decode batch sizes %s", self.capture_sizes)

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
