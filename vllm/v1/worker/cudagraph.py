"""CUDA graphs for pure-decode steps: one captured model forward per batch size, replayed for smaller batches.

A step in which every request has exactly one query token runs as the graph of the smallest captured size
B >= num_reqs; the rows past num_reqs are padding (see input_prep.py) and their outputs are ignored. Only the
model forward (input ids and positions -> hidden states) is captured; logits and the sampler run eagerly.

Invariants:
- Graphs read their inputs from the runner's persistent device buffers and write the hidden states to one
  static output per size; a replay is valid only after those buffers were filled for B rows.
- Capture happens once, after the KV cache is allocated, largest size first into one shared memory pool; each
  size is warmed up eagerly (Triton compilation, cuBLAS workspaces) before it is captured.
- Attention's num_splits is fixed per size (it sets the grid), chosen for max_model_len.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

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
