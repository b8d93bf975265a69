"""Token embedding and the LM head (which may share the embedding's weight), split by vocabulary rows.

vLLM's rule under tensor parallelism: the vocabulary is padded to a multiple of 64 (`pad_vocab_size`), then split
into tensor_parallel_size equal slices; rank r holds rows [r * per_rank, (r + 1) * per_rank) of the padded table,
the padding rows (ids >= vocab_size) zero. The embedding looks up the ids of its slice, writes zeros for the others
and sums over the group, so every rank gets every token's embedding. The LM head gives each rank the logits of its
slice; `LogitsProcessor` (logits_processor.py) gathers them and drops the padding columns.

Invariants:
- At one rank nothing is padded: the table is [vocab_size, embedding_dim] and the embedding is one F.embedding.
- The loaders take the whole checkpoint table [vocab_size, embedding_dim] (`full_shape`); each rank keeps its rows
  and zeroes its padding rows, so a tied LM head (the same parameter) gets the same layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size,
                                             tensor_model_parallel_all_reduce)
from vllm.model_executor.utils import divide, set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    """vocab_size rounded up to a multiple of pad_to."""
    return -(-vocab_size // pad_to) * pad_to


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # NOTE: one rank keeps the table unpadded, so its logits are [n, vocab_size] without a slice or a copy.
        self.num_embeddings_padded = (num_embeddings if self.tp_size == 1
                                      else pad_vocab_size(num_embeddings, padding_size))
        self.num_embeddings_per_partition = divide(self.num_embeddings_padded, self.tp_size,
                                                   f"the vocabulary padded to a multiple of {padding_size}")
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        # Rows of this rank's slice that are real tokens (the rest is padding).
        self.num_org_embeddings_per_partition = max(0, min(self.num_embeddings_per_partition,
                                                           num_embeddings - self.vocab_start_index))
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader,
                                       "full_shape": (num_embeddings, embedding_dim)})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"checkpoint weight of shape {tuple(loaded_weight.shape)} does not fit a parameter of "
                             f"shape {expected}")
        real = self.num_org_embeddings_per_partition
        if real > 0:
            param.data[:real].copy_(loaded_weight.narrow(0, self.vocab_start_index, real))
        param.data[real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [n] int64 -> [n, embedding_dim]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_slice = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)  # [n] bool
        local_ids = (input_ids - self.vocab_start_index) * in_slice
        embeddings = F.embedding(local_ids, self.weight).masked_fill_(~in_slice.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(embeddings)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_per_partition={self.num_embeddings_per_partition}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> this rank's logits [n, num_embeddings_per_partition]; `tie_weights` makes it share the
    embedding's parameter. The whole [n, vocab_size] logits come from LogitsProcessor."""

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> None:
        self.weight = embed_tokens.weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab per partition]
        return F.linear(hidden_states, self.weight)
