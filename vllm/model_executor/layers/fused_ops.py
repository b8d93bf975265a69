"""Fused elementwise ops of the decoder layer (Triton): RMSNorm (optionally with the residual add before it),
SiluAndMul and neox rotary embedding, one launch each where the torch code launches 2 to 16 kernels.

Role: RMSNorm, SiluAndMul and RotaryEmbedding call these wrappers when `use_fused_ops(x)` holds (CUDA
tensors); otherwise they run their `forward_native` torch code, the reference these kernels follow.

Invariants:
- Rounding is the torch code's, step by step: every intermediate that torch materialises in the input dtype
  (the residual sum, x * rstd, silu(gate), x1 * cos, ...) is rounded to that dtype here too (nearest even),
  and each binary op on 16-bit floats is computed in float32 and rounded once, as torch does. FMA contraction
  is off; rsqrt and exp are the ones torch calls on the device. What differs is the reduction order of the
  RMSNorm variance: a rare 1-ulp flip of x * rstd, which the weight multiply carries into the output as up
  to 2 ulps; float32 results differ by a few ulps.
- Inputs need a unit stride on the last dim only; rows may be strided (column slices of a fused qkv or
  gate-up output, the heads of such a slice). Outputs are new contiguous tensors; inputs are never written.
- Grids and allocations depend on shapes only (no host sync), so every launch can be captured in a CUDA graph.
  Zero rows allocate empty outputs and launch nothing.

The floor is memory traffic; per call, with n rows and e bytes per element:
- rms_norm: read n * D * e (+ D weights), write n * D * e; with the residual: read 2nDe, write 2nDe.
- silu_and_mul: read n * 2d * e, write n * d * e.
- rotary: read and write n * (H_q + H_kv) * head_size * e each, plus n * head_size * 4 bytes of cos/sin.
For Qwen2.5-1.5B (D 1536, d 8960, 12 + 2 heads of 128) in bf16 at 512 rows: 3.1 MB (norm), 6.3 MB (add +
norm), 27.5 MB (silu_and_mul), 3.9 MB (rotary): 44 MB per layer, about 10 us at H200 bandwidth.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Widest row one RMSNorm program holds in registers; wider rows keep the torch code.
MAX_NORM_HIDDEN = 32768
# Elements per program (the `max_tile` default). On CUDA a tile is one row or a few short ones (qk_norm heads,
# small models), enough programs to fill the GPU. NOTE: the interpreter runs programs one after another in
# Python, so CPU tensors get large tiles (few programs); the arithmetic is the same either way.
CUDA_TILE = {"rms_norm": 4096, "silu_and_mul": 1024, "rotary": 1024}
INTERPRETER_TILE = 65536
# Tests set this to route CPU tensors through the kernels under TRITON_INTERPRET (see use_fused_ops).
INTERPRET_CPU_TENSORS = False


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the layers run the Triton kernels on x: CUDA tensors, and CPU tensors under the Triton
    interpreter when INTERPRET_CPU_TENSORS is set.

    NOTE: not every CPU tensor under the interpreter: tests/conftest.py sets TRITON_INTERPRET for the whole CPU
    suite, whose engine and Hugging Face comparison tests keep the torch code (interpreting the 4 to 6
    launches per layer would also double the suite's run time)."""
    if x.dtype not in _DTYPES:
        return False
    return x.is_cuda or (INTERPRET_CPU_TENSORS and bool(triton.knobs.runtime.interpret))


def _max_tile(x: torch.Tensor, op: str, max_tile: int | None) -> int:
    if max_tile is None:
        return CUDA_TILE[op] if x.is_cuda else INTERPRETER_TILE
    if max_tile < 1 or max_tile & (max_tile - 1):
        raise ValueError(f"max_tile must be a power of two, got {max_tile}")
    return max_tile


def _num_warps(tile: int) -> int:
    return max(1, min(16, tile // 256))


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """x: float32 -> float32 holding x rounded to nearest (ties to even) in DTYPE."""
    if DTYPE == tl.bfloat16:
        # NOTE: by bits rather than x.to(tl.bfloat16): the Triton interpreter truncates that cast, and the
        # CPU tests must run the GPU's arithmetic. NaNs pass through unchanged.
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    elif DTYPE == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _cast(x, DTYPE: tl.constexpr):
    """x: float32 -> DTYPE, rounded to nearest even (exact for the final conversion, see _round)."""
    return _round(x, DTYPE).to(DTYPE)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    num_rows,
    num_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Row r of the flattened leading dims lives at (r // num_inner) * stride_outer + (r % num_inner) * stride_inner.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    col_mask = cols < hidden_size
    mask = (rows < num_rows)[:, None] & col_mask[None, :]  # [BLOCK_ROWS, BLOCK_D]
    outer, inner = rows // num_inner, rows % num_inner
    x_offs = (outer * stride_x_outer + inner * stride_x_inner)[:, None] + cols[None, :]
    out_offs = rows[:, None] * hidden_size + cols[None, :]
    x = tl.load(x_ptr + x_offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_offs = (outer * stride_r_outer + inner * stride_r_inner)[:, None] + cols[None, :]
        r = tl.load(residual_ptr + r_offs, mask=mask, other=0.0)
        # NOTE: the sum is rounded to the input dtype before the statistics, as `x + residual` is in torch.
        x = _cast(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + out_offs, x, mask=mask)
    x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=1) / hidden_size  # [BLOCK_ROWS] float32
    # NOTE: rsqrt as torch's: approximate on CUDA (rsqrtf), 1 / sqrt in the interpreter (as torch on CPU).
    rstd = tl.math.rsqrt(variance + eps)
    normed = _round(x * rstd[:, None], x_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_D]
    tl.store(out_ptr + out_offs, _cast(normed * w[None, :], out_ptr.dtype.element_ty), mask=mask)


def _as_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """x: [..., D] -> (x or a 3-D view/copy, stride_outer, stride_inner, num_inner) addressing its rows."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 1:
        return x, 0, 0, 1
    if x.dim() == 2:
        return x, x.stride(0), 0, 1
    x = x.reshape(-1, x.shape[-2], x.shape[-1])  # a view for a 3-D input, e.g. heads of a qkv column slice
    return x, x.stride(0), x.stride(1), x.shape[1]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             max_tile: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] (unit stride on D; leading dims may be strided). Without residual: norm(x) * weight. With
    residual (same shape and dtype as x): (norm(x + residual) * weight, x + residual). Outputs are contiguous."""
    hidden_size = x.shape[-1]
    if hidden_size > MAX_NORM_HIDDEN:
        raise ValueError(f"rms_norm supports hidden sizes up to {MAX_NORM_HIDDEN}, got {hidden_size}")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    num_rows = x.numel() // hidden_size if hidden_size else 0
    if num_rows > 0:
        x_rows, stride_x_outer, stride_x_inner, num_inner = _as_rows(x)
        if residual is not None:
            r_rows, stride_r_outer, stride_r_inner, _ = _as_rows(residual.expand_as(x))
        else:
            r_rows, stride_r_outer, stride_r_inner = x_rows, 0, 0
        block_d = triton.next_power_of_2(hidden_size)
        block_rows = max(1, min(_max_tile(x, "rms_norm", max_tile) // block_d, triton.next_power_of_2(num_rows)))
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x_rows, r_rows, weight, out, residual_out if residual_out is not None else out,
            num_rows, num_inner, stride_x_outer, stride_x_inner, stride_r_outer, stride_r_inner,
            hidden_size, eps, HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d,
            num_warps=_num_warps(block_rows * block_d), enable_fp_fusion=False)
    if residual_out is None:
        return out
    return out, residual_out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, num_rows, stride_x_row, d, BLOCK_ROWS: tl.constexpr,
                         BLOCK_D: tl.constexpr, LIBDEVICE_EXP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # [BLOCK_ROWS]
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows < num_rows)[:, None] & (cols < d)[None, :]  # [BLOCK_ROWS, BLOCK_D]
    gate_ptrs = x_ptr + rows[:, None] * stride_x_row + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + d, mask=mask, other=0.0).to(tl.float32)
    # NOTE: silu(gate) is rounded to the input dtype before the product, as F.silu(gate) * up is in torch.
    # NOTE: on CUDA libdevice's expf, which torch's silu calls, rather than tl.exp (ex2.approx); the interpreter
    # has no libdevice, and its tl.exp is numpy's.
    if LIBDEVICE_EXP:
        exp_neg = libdevice.exp(-gate)
    else:
        exp_neg = tl.exp(-gate)
    act = _round(tl.math.div_rn(gate, 1.0 + exp_neg), x_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * d + cols[None, :], _cast(act * up, out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, max_tile: int | None = None) -> torch.Tensor:
    """x: [..., 2 * d] (unit stride on the last dim; rows may be strided) -> silu(x[..., :d]) * x[..., d:],
    [..., d] contiguous."""
    d = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    num_rows = out.numel() // d if d else 0
    if num_rows > 0:
        if x.stride(-1) != 1:
            x = x.contiguous()
        x = x.reshape(num_rows, 2 * d)  # a view for a 2-D (or contiguous) input
        tile = _max_tile(x, "silu_and_mul", max_tile)
        block_d = min(triton.next_power_of_2(d), tile)
        block_rows = max(1, min(tile // block_d, triton.next_power_of_2(num_rows)))
        _silu_and_mul_kernel[(triton.cdiv(num_rows, block_rows), triton.cdiv(d, block_d))](
            x, out, num_rows, x.stride(0), d, BLOCK_ROWS=block_rows, BLOCK_D=block_d, LIBDEVICE_EXP=x.is_cuda,
            num_warps=_num_warps(block_rows * block_d), enable_fp_fusion=False)
    return out


@triton.jit
def _rotate_heads(positions_ptr, cos_sin_ptr, src_ptr, dst_ptr, num_tokens, stride_src_row, stride_cache_row,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_T: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    """Neox rotation of BLOCK_T tokens' heads: src rows [NUM_HEADS * 2 * HALF] -> dst rows, contiguous.

    Tile row r is head r % HEADS_PAD of token r // HEADS_PAD of the block."""
    r = tl.arange(0, BLOCK_T * HEADS_PAD)
    tokens = tl.program_id(0).to(tl.int64) * BLOCK_T + r // HEADS_PAD  # [BLOCK_T * HEADS_PAD]
    heads = r % HEADS_PAD
    offs_d = tl.arange(0, HALF_PAD)
    row_mask = (tokens < num_tokens) & (heads < NUM_HEADS)
    mask = row_mask[:, None] & (offs_d < HALF)[None, :]  # [BLOCK_T * HEADS_PAD, HALF_PAD]
    dtype = dst_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + tokens, mask=row_mask, other=0).to(tl.int64)
    cache_ptrs = cos_sin_ptr + pos[:, None] * stride_cache_row + offs_d[None, :]
    # NOTE: the float32 cache is rounded to the query dtype first, as `cos_sin.to(query.dtype)` is in torch.
    cos = _round(tl.load(cache_ptrs, mask=mask, other=0.0), dtype)
    sin = _round(tl.load(cache_ptrs + HALF, mask=mask, other=0.0), dtype)
    src = src_ptr + tokens[:, None] * stride_src_row + heads[:, None] * (2 * HALF) + offs_d[None, :]
    dst = dst_ptr + tokens[:, None] * (NUM_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # NOTE: each product is rounded to the dtype before the sum, as torch materialises x1 * cos etc.
    o1 = _round(x1 * cos, dtype) - _round(x2 * sin, dtype)
    o2 = _round(x2 * cos, dtype) + _round(x1 * sin, dtype)
    tl.store(dst, _cast(o1, dtype), mask=mask)
    tl.store(dst + HALF, _cast(o2, dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    cos_sin_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    num_tokens,
    stride_q_row,
    stride_k_row,
    stride_cache_row,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    _rotate_heads(positions_ptr, cos_sin_ptr, q_ptr, q_out_ptr, num_tokens, stride_q_row, stride_cache_row,
                  NUM_Q_HEADS, Q_HEADS_PAD, BLOCK_T, HALF, HALF_PAD)
    _rotate_heads(positions_ptr, cos_sin_ptr, k_ptr, k_out_ptr, num_tokens, stride_k_row, stride_cache_row,
                  NUM_K_HEADS, K_HEADS_PAD, BLOCK_T, HALF, HALF_PAD)


def _token_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x: [n, ...] -> [n, row] with a unit stride inside the row (a view for a column slice of qkv)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(n, math.prod(x.shape[1:]))


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int, max_tile: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [n] int; query: [n, num_heads * head_size]; key: [n, num_kv_heads * head_size] (rows may be
    strided); cos_sin_cache: [max_position, head_size] float32 -> rotated (query, key), new contiguous tensors
    of shape [n, num_heads * head_size] and [n, num_kv_heads * head_size] in query's dtype.

    Positions are not range-checked (that would need a host sync); they must be < max_position."""
    if head_size % 2:
        raise ValueError(f"rotary head_size must be even, got {head_size}")
    n = query.shape[0]
    query, key = _token_rows(query, n), _token_rows(key, n)
    num_q_heads, num_k_heads = query.shape[1] // head_size, key.shape[1] // head_size
    q_out = torch.empty((n, num_q_heads * head_size), dtype=query.dtype, device=query.device)
    k_out = torch.empty((n, num_k_heads * head_size), dtype=query.dtype, device=query.device)
    if n > 0:
        half = head_size // 2
        q_heads_pad, half_pad = triton.next_power_of_2(num_q_heads), triton.next_power_of_2(half)
        if cos_sin_cache.stride(-1) != 1:
            cos_sin_cache = cos_sin_cache.contiguous()
        tile = _max_tile(query, "rotary", max_tile)
        block_t = max(1, min(tile // (q_heads_pad * half_pad), triton.next_power_of_2(n)))
        _rotary_kernel[(triton.cdiv(n, block_t),)](
            positions, cos_sin_cache, query, key, q_out, k_out, n,
            query.stride(0), key.stride(0), cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
            Q_HEADS_PAD=q_heads_pad, K_HEADS_PAD=triton.next_power_of_2(num_k_heads), BLOCK_T=block_t,
            HALF=half, HALF_PAD=half_pad, num_warps=_num_warps(block_t * q_heads_pad * half_pad),
            enable_fp_fusion=False)
    return q_out, k_out
