"""Test helpers: tiny random Hugging Face checkpoints and a paged-KV step runner for the model classes."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vllm.forward_context import set_forward_context
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.backends.torch_ref import TorchAttentionBackend
from vllm.v1.attention.layer import set_attn_backend

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=160, max_position_embeddings=128, initializer_range=0.1)


def make_hf_model(kind: str, path: Path, seed: int = 0, max_shard_size: str | None = None,
                  **overrides: Any) -> nn.Module:
    """Build a random tiny float32 HF causal LM, save it to `path`, return it in eval mode."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[kind]
    config = config_cls(**{**TINY, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # NOTE: HF zero-inits biases and ones-inits norms; randomize so they are checked.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class PagedRunner:
    """Runs the model a step at a time over a paged KV cache with shuffled block ids, like the model runner."""

    def __init__(self, model: nn.Module, num_layers: int, num_kv_heads: int, head_size: int,
                 num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        set_attn_backend(model, TorchAttentionBackend())
        dtype = next(model.parameters()).dtype
        self.kv_caches = [torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
                          for _ in range(num_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[str, list[int]], all_logits: bool = False) -> torch.Tensor:
        """Feed each request its next tokens; returns logits of each request's last fed token [num_reqs, V],
        or of every fed token [num_tokens, V] with all_logits."""
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        for req_id, tokens in chunks.items():
            start = self.num_computed.get(req_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(req_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            for pos in range(start, end):
                slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
            input_ids += tokens
            positions += range(start, end)
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            self.num_computed[req_id] = end
        max_blocks = max(len(self.block_tables[r]) for r in chunks)
        block_table = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, req_id in enumerate(chunks):
            table = self.block_tables[req_id]
            block_table[i, :len(table)] = torch.tensor(table, dtype=torch.int32)
        qsl = torch.tensor(query_start_loc, dtype=torch.int32)
        sl = torch.tensor(seq_lens, dtype=torch.int32)
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids), num_reqs=len(chunks),
            max_query_len=max(len(t) for t in chunks.values()), max_seq_len=max(seq_lens),
            query_start_loc=qsl, seq_lens=sl, block_table=block_table,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=qsl.clone(), seq_lens_cpu=sl.clone())
        with set_forward_context(metadata, self.kv_caches):
            hidden = self.model(torch.tensor(input_ids, dtype=torch.int64),
                                torch.tensor(positions, dtype=torch.int64))
        if all_logits:
            return self.model.compute_logits(hidden)
        return self.model.compute_logits(hidden[qsl[1:].long() - 1])
