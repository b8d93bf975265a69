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
  after the step was launched, and the engine launches step N+2 only after step N's `get_output()` returned
  (the batch queue is two deep), by which time the output thread has waited for all of step N's copies and
  built every list that reads a static output directly (its mask lists too when they overflow K; deferred mask
  lists, VLLM_ENGINE_DEFER_MASK_LISTS, read only the host copies), so the set that step N+2 reuses is free.
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
