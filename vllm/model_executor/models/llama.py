"""Llama causal LM, and the decoder that Qwen2 and Qwen3 reuse.

The attention flavours differ only in switches read by `LlamaForCausalLM` subclasses: `qkv_bias` (Qwen2 always
has q/k/v biases), `o_bias`, and `qk_norm` (Qwen3 RMS-normalizes every query and key head before rope).
Checkpoint names are Hugging Face's; `load_weights` maps q/k/v_proj onto the fused qkv_proj and gate/up_proj
onto gate_up_proj through each parameter's weight_loader. Attention reads its metadata and KV cache from the
forward context, so `forward` takes only token ids and positions (flat: [num_tokens]).

Under tensor parallelism (the group of vllm/distributed/parallel_state.py, read when the model is built) each rank
holds num_attention_heads / tp query heads and max(1, num_key_value_heads / tp) KV heads (qkv_proj's layout),
intermediate_size / tp MLP rows and its vocabulary slice; o_proj and down_proj sum over the group, q/k norms
(per head) and the other norms are replicated. The weight loaders cut each rank's shard from the full checkpoint
tensors, and `compute_logits` returns the whole [n, vocab_size] logits on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding, get_rope, get_rope_parameters
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.utils import checkpoint_shard_shape, default_weight_loader
from vllm.v1.attention.layer import Attention


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported; only silu is")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        self.total_num_heads = int(config.num_attention_heads)
        self.total_num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.total_num_heads)
        if self.total_num_heads % self.total_num_kv_heads != 0:
            raise ValueError(f"num_attention_heads {self.total_num_heads} is not a multiple of num_key_value_heads "
                             f"{self.total_num_kv_heads}")
        self.head_dim = _head_dim(config)
        hidden_size = int(config.hidden_size)
        self.qkv_proj = QKVParallelLinear(hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads,
                                          bias=qkv_bias)
        # This rank's heads: num_attention_heads / tp queries, max(1, num_key_value_heads / tp) keys and values.
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, hidden_size, bias=o_bias)
        self.rotary_emb = rotary_emb
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.q_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads, layer_idx)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)  # [n, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            n = q.shape[0]
            q = self.q_norm(q.reshape(n, self.num_heads, self.head_dim)).view(n, self.q_size)
            k = self.k_norm(k.reshape(n, self.num_kv_heads, self.head_dim)).view(n, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        # NOTE: v stays a strided column slice of qkv: the attention backends' cache writes take row strides.
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, rotary_emb: RotaryEmbedding, qkv_bias: bool, o_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        hidden_size = int(config.hidden_size)
        eps = float(getattr(config, "rms_norm_eps", 1e-6))
        self.self_attn = LlamaAttention(config, layer_idx, rotary_emb, qkv_bias, o_bias, qk_norm)
        self.mlp = LlamaMLP(hidden_size, int(config.intermediate_size), getattr(config, "hidden_act", "silu"),
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(int(config.vocab_size), int(config.hidden_size))
        # NOTE: one rotary embedding (one cos/sin cache) is shared by every layer.
        rotary_emb = get_rope(_head_dim(config), int(getattr(config, "max_position_embeddings", 2048)),
                              get_rope_parameters(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary_emb, qkv_bias, o_bias, qk_norm)
            for i in range(int(config.num_hidden_layers)))
        self.norm = RMSNorm(int(config.hidden_size), float(getattr(config, "rms_norm_eps", 1e-6)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [n, hidden]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (fused parameter, checkpoint projection, shard id)
    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        qkv_bias, o_bias, qk_norm = self._attention_switches(hf_config)
        self.model = LlamaModel(hf_config, qkv_bias, o_bias, qk_norm)
        self.lm_head = ParallelLMHead(int(hf_config.vocab_size), int(hf_config.hidden_size))
        self.logits_processor = LogitsProcessor(int(hf_config.vocab_size))
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @staticmethod
    def _attention_switches(hf_config: Any) -> tuple[bool, bool, bool]:
        """(qkv_bias, o_bias, qk_norm)."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias, False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [num_tokens] int64 -> hidden states [num_tokens, hidden]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab]
        """The whole vocabulary's logits on every rank (a collective under tensor parallelism)."""
        if self.lm_head.tp_size == 1:
            return self.lm_head(hidden_states)  # NOTE: nothing to gather: LogitsProcessor's module call skipped
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face named tensors; returns the names of the parameters that are now fully loaded."""
        shards_seen: dict[str, set[str | int]] = {}
        loaded: set[str] = set()
        for name, tensor in weights:
            route = self.route_checkpoint_weight(name)
            if route is None:
                continue
            param_name, param, shard_id = route
            if shard_id is None:
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(param_name)
            else:
                param.weight_loader(param, tensor, shard_id)
                shards_seen.setdefault(param_name, set()).add(shard_id)
        for param_name, seen in shards_seen.items():
            module_name = param_name.rsplit(".", 1)[0]
            expected = {s for p, _, s in self.stacked_params_mapping if module_name.endswith(p)}
            if seen >= expected:
                loaded.add(param_name)
        return loaded

    def route_checkpoint_weight(self, name: str) -> tuple[str, nn.Parameter, str | int | None] | None:
        """Where the checkpoint tensor `name` goes: (parameter name, parameter, shard id or None for the whole
        parameter), or None for a tensor the model does not keep (rotary inv_freq, a tied lm_head). ValueError
        for a name that matches no parameter."""
        if "rotary_emb.inv_freq" in name:
            return None
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None
        params = self._params_by_name()
        for param_suffix, weight_suffix, shard_id in self.stacked_params_mapping:
            if weight_suffix + "." in name:
                param_name = name.replace(weight_suffix + ".", param_suffix + ".")
                return param_name, self._param(params, param_name, name), shard_id
        return name, self._param(params, name, name), None

    def checkpoint_weight_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape the checkpoint tensor `name` must have, the whole tensor's whatever the rank's shard (None:
        a tensor the model skips); ValueError for a name that matches no parameter."""
        route = self.route_checkpoint_weight(name)
        if route is None:
            return None
        _, param, shard_id = route
        return checkpoint_shard_shape(param, shard_id)

    def _params_by_name(self) -> dict[str, nn.Parameter]:
        params = self.__dict__.get("_params_cache")
        if params is None:
            params = dict(self.named_parameters())
            self.__dict__["_params_cache"] = params
        return params

    def _param(self, params: dict[str, nn.Parameter], param_name: str, checkpoint_name: str) -> nn.Parameter:
        if param_name not in params:
            raise ValueError(f"checkpoint weight {checkpoint_name!r} matches no parameter of "
                             f"{type(self).__name__}")
        return params[param_name]
