"""Token embedding and the LM head (which may share the embedding's weight).

Names follow vLLM; today one rank holds the whole vocabulary, unpadded, so logits are exactly [n, vocab_size].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.utils import default_weight_loader, set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": default_weight_loader})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, embedding_dim]
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}"


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits; `tie_weights` makes it share the embedding's parameter."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.weight = embed_tokens.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        return F.linear(hidden_states, self.weight)
