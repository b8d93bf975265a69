"""Rotary position embedding (neox style: rotate halves, as Hugging Face Llama does) with rope scaling.

The config is read from either spelling: transformers < 5 writes `rope_theta` at the top level and an optional
`rope_scaling` dict; transformers 5 writes one `rope_parameters` dict with `rope_theta` inside. Supported rope
types: default, linear, llama3, yarn; any other raises ValueError ("dynamic" NTK depends on the running sequence
length in Hugging Face and is not supported).

Invariant: the cos/sin cache is float32, one row per position up to `max_position`, laid out
[cos(f_0..f_{d/2-1}) | sin(f_0..f_{d/2-1})] and already multiplied by the rope type's attention factor; it is
cast to the query dtype at use, matching Hugging Face's cos/sin rounding. On CUDA tensors query and key are
rotated by one fused kernel (fused_ops.rotary_embedding) with the same roundings.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from vllm.model_executor.layers.fused_ops import rotary_embedding, use_fused_ops

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def get_rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The effective rope parameters of a config: a dict with at least rope_type and rope_theta."""
    params: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        value = getattr(hf_config, key, None)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ValueError(f"config {key} must be a dict, got {value!r}")
        if any(isinstance(v, dict) for v in value.values()):
            raise ValueError(f"per-layer-type {key} are not supported: {value!r}")
        params.update(value)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = getattr(hf_config, "rope_theta", None) or 10000.0
    max_position = int(getattr(hf_config, "max_position_embeddings", 2048))
    top_level_original = getattr(hf_config, "original_max_position_embeddings", None)
    if top_level_original is not None:
        params["original_max_position_embeddings"] = top_level_original
    else:
        params.setdefault("original_max_position_embeddings", max_position)
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial} is not supported")
    return params


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:  # [rotary_dim // 2] float32
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base ** exponents)


def _llama3_inv_freq(rotary_dim: int, base: float, params: dict[str, Any]) -> torch.Tensor:
    inv_freq = _default_inv_freq(rotary_dim, base)
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # NOTE: short wavelengths keep their frequency, long ones are divided by factor, and the band between
    # is interpolated smoothly (Llama 3.1's recipe).
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(rotary_dim: int, base: float, params: dict[str, Any],
                   max_position: int) -> tuple[torch.Tensor, float]:
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(original / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> None:
        super().__init__()
        self.head_size = head_size
        self.max_position = max_position
        inv_freq = inv_freq.to(torch.float32)
        positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_size // 2]
        cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_position, head_size] float32

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [n] int64; query: [n, num_heads * head_size]; key: [n, num_kv_heads * head_size] (rows may
        be strided, e.g. column slices of a fused qkv) -> new contiguous tensors of the same shapes."""
        if use_fused_ops(query) and key.dtype == query.dtype:
            return rotary_embedding(positions, query, key, self.cos_sin_cache, self.head_size)
        return self.forward_native(positions, query, key)

    def forward_native(self, positions: torch.Tensor, query: torch.Tensor,
                       key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch code: CPU runs, and the reference of the fused kernel."""
        cos_sin = self.cos_sin_cache.index_select(0, positions)  # [n, head_size]
        cos, sin = cos_sin.to(query.dtype).chunk(2, dim=-1)  # [n, head_size // 2] each
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        x = x.view(n, -1, self.head_size)
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.view(n, -1)

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}"


def get_rope(head_size: int, max_position: int, rope_parameters: dict[str, Any]) -> RotaryEmbedding:
    """Build the rotary embedding for `get_rope_parameters(hf_config)`."""
    rope_type = rope_parameters.get("rope_type", "default")
    base = float(rope_parameters.get("rope_theta", 10000.0))
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(head_size, base)
    elif rope_type == "linear":
        inv_freq = _default_inv_freq(head_size, base) / float(rope_parameters["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(head_size, base, rope_parameters)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(head_size, base, rope_parameters, max_position)
    else:
        raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type in ("linear", "llama3", "yarn") and rope_parameters.get("factor") is not None:
        # NOTE: scaled ropes serve positions up to the original context times the factor.
        scaled_len = int(float(rope_parameters["original_max_position_embeddings"]) * float(rope_parameters["factor"]))
        max_position = max(max_position, scaled_len)
    return RotaryEmbedding(head_size, max_position, inv_freq, attention_factor)
