"""LogitsProcessor (vLLM's name): hidden states -> the whole [n, vocab_size] logits, on every rank.

Each rank's LM head gives the logits of its vocabulary slice; under tensor parallelism they are all-gathered
along the vocabulary (rank order is vocabulary order) and the padding columns (ids >= vocab_size, all in the last
slices) are dropped.

Invariants:
- Every rank returns the same [n, vocab_size] tensor, contiguous, so the sampler (and its CUDA graphs) runs
  unchanged on whichever rank samples. It is a collective: every rank must call it for the same rows.
- At one rank it is the LM head's matmul alone: no gather, no slice, no copy.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.distributed.parallel_state import tensor_model_parallel_all_gather
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, lm_head: ParallelLMHead, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden_states)  # [n, vocab per partition]
        if lm_head.tp_size == 1:
            return logits
        # NOTE: gathered to every rank, not to rank 0 alone: NCCL has no gather (parallel_state's gather is an
        # all-gather too), and so every rank can run the same sampler step (docs/parallelism.md).
        logits = tensor_model_parallel_all_gather(logits, dim=-1)  # [n, vocab padded]
        if logits.shape[-1] != self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        return logits

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}"
