"""Penalties and logits processors on the device: vLLM's definitions, in vLLM's order, on float32 logits.

Order (vLLM v1 `Sampler.apply_logits_processors`): allowed_token_ids -> bad_words -> logit_bias -> min_tokens ->
repetition -> frequency -> presence; temperature, min-p, top-k and top-p come after (the sampler). The -inf
writes of the first steps commute with everything after them; logit_bias does not commute with the repetition
penalty, and comes first as in vLLM. The sampler applies the bias entries, then the penalties, then the -inf writes
of allowed_token_ids and bad_words (the same result: -inf stays -inf through every later step), so that a step
without bias entries runs the penalties as one pass from the model's logits to the float32 copy.

Definitions:
- repetition (tokens of the prompt or the output so far): logit > 0 divided by the penalty, logit <= 0 multiplied
  by it (vLLM's CUDA kernel and HF transformers' RepetitionPenaltyLogitsProcessor);
- frequency: logit -= frequency_penalty * count (output tokens only); presence: logit -= presence_penalty *
  (count > 0). A neutral row (1, 0, 0) is left bitwise unchanged (x / 1, x * 1, x - 0 are exact).
- logit_bias, the min_tokens bans and single-token bad words are one sparse list of (row, token, value) added to
  the logits (a ban is -inf; x + -inf = -inf for every finite x, as vLLM's assignment of -inf).

State (the persistent pool of vllm/v1/worker/penalty_state.py): one int32 per (slot, token): the token's count in
the output plus PROMPT_BIT when it occurs in the prompt; and the slot's last W output tokens (-1 before the
first), which multi-token bad words are matched against. Rows without state read the pool's scratch slot (all
zeros), whose adds are 0.

Every function keeps its shapes fixed by its arguments (no data-dependent sizes, no host sync), so it runs inside
the sampler's CUDA graphs; entries whose row is past the batch are ignored (a graph of a smaller size warmed up on
another step's entries must not index out of bounds).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Set in a state entry when the token occurs in the prompt; the low bits count it in the output.
PROMPT_BIT = 1 << 30
_COUNT_MASK = PROMPT_BIT - 1
_NEG_INF = float("-inf")


def apply_sparse_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                      values: torch.Tensor) -> None:
    """logits: [num_reqs, V] float32, in place; rows, token_ids: [E] int64; values: [E] float32. Padding entries
    are (0, 0, 0.0)."""
    inside = rows < logits.shape[0]
    values = torch.where(inside, values, 0.0)
    logits.index_put_((torch.where(inside, rows, 0), torch.where(inside, token_ids, 0)), values, accumulate=True)


def apply_allowed(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """allowed_token_ids as (row, id) entries: an entry (row, V) marks the row restricted, (row, id) allows id,
    padding entries are (0, V + 1). Every id not allowed in a restricted row becomes -inf (in place)."""
    num_reqs, vocab_size = logits.shape
    allowed = torch.zeros((num_reqs, vocab_size + 2), dtype=torch.bool, device=logits.device)
    inside = rows < num_reqs
    allowed.index_put_((torch.where(inside, rows, 0), torch.where(inside, token_ids, vocab_size + 1)),
                       torch.ones_like(rows, dtype=torch.bool))
    restricted = allowed[:, vocab_size:vocab_size + 1]  # [num_reqs, 1]
    logits.masked_fill_(restricted & ~allowed[:, :vocab_size], _NEG_INF)


def apply_bad_word_prefixes(logits: torch.Tensor, recent: torch.Tensor, slot: torch.Tensor, rows: torch.Tensor,
                            prefixes: torch.Tensor, last_ids: torch.Tensor) -> None:
    """Multi-token bad words: entry e bans last_ids[e] in row rows[e] when the row's last output tokens equal
    prefixes[e] (right-aligned, [E, W] int64, -2 = any token to the left of the word). recent: [num_slots, W]
    int32, the last W output tokens of each slot; slot: [num_reqs] int64. Padding entries have last_ids = -1."""
    num_reqs, vocab_size = logits.shape
    inside = rows < num_reqs
    rows = torch.where(inside, rows, 0)
    tail = recent.index_select(0, slot.index_select(0, rows)).to(torch.int64)  # [E, W]
    match = ((prefixes == tail) | (prefixes == -2)).all(dim=1) & (last_ids >= 0) & inside  # [E]
    ban = torch.where(match, _NEG_INF, 0.0)  # [E] float32
    logits.index_put_((rows, last_ids.clamp(0, vocab_size - 1)), ban, accumulate=True)


def apply_penalties(logits: torch.Tensor, state: torch.Tensor, slot: torch.Tensor, repetition: torch.Tensor,
                    frequency: torch.Tensor, presence: torch.Tensor, out: torch.Tensor | None = None,
                    use_triton: bool | None = None) -> torch.Tensor:
    """Repetition, frequency and presence penalties: logits [num_reqs, V] (float32, or the model's dtype when
    `out` is given) -> out ([num_reqs, V] float32; default: logits, in place). state: [num_slots, V] int32 (the
    pool); slot: [num_reqs] int64; repetition, frequency, presence: [num_reqs] float32 (1, 0, 0 where off).
    use_triton (default: on CUDA tensors) runs _apply_penalties_kernel, one pass with the same roundings as the
    torch code below (IEEE division, no fused multiply-add), which is its reference."""
    out = logits if out is None else out
    if use_triton if use_triton is not None else logits.is_cuda:
        num_reqs, vocab_size = logits.shape
        grid = (num_reqs, triton.cdiv(vocab_size, _BLOCK))
        _apply_penalties_kernel[grid](logits, logits.stride(0), out, out.stride(0), state, state.stride(0), slot,
                                      repetition, frequency, presence, vocab_size, COUNT_MASK=_COUNT_MASK,
                                      BLOCK=_BLOCK, enable_fp_fusion=False)
        return out
    # NOTE: the floor is 10 B per (row, id): the int32 state, the bf16 logits read, the float32 logits written
    # (256 rows x 151,936 ids: 389 MB, 81 us at 4.8 TB/s), which the kernel meets when no logit_bias or min_tokens
    # entry comes before it; this torch code moves ~10x that, one pass per op. vLLM's per-step scatter zeroes two
    # [num_reqs, V + 1] int64 tensors (16 B per (row, id)) before any penalty math.
    entry = state.index_select(0, slot)  # [num_reqs, V] int32
    counts = (entry & _COUNT_MASK).to(torch.float32)
    seen = entry != 0  # in the prompt or the output
    x = logits.to(torch.float32)
    rep = repetition[:, None]
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(seen, penalised, x)
    x = x - frequency[:, None] * counts
    out.copy_(x - presence[:, None] * (counts > 0).to(torch.float32))
    return out


_BLOCK = 1024


@triton.jit
def _apply_penalties_kernel(src_ptr, src_stride, dst_ptr, dst_stride, state_ptr, state_stride, slot_ptr, rep_ptr,
                            freq_ptr, pres_ptr, vocab_size, COUNT_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    slot = tl.load(slot_ptr + row).to(tl.int64)
    rep = tl.load(rep_ptr + row)
    freq = tl.load(freq_ptr + row)
    pres = tl.load(pres_ptr + row)
    x = tl.load(src_ptr + row * src_stride + offs, mask=inside, other=0.0).to(tl.float32)
    entry = tl.load(state_ptr + slot * state_stride + offs, mask=inside, other=0)
    counts = (entry & COUNT_MASK).to(tl.float32)
    penalised = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
    x = tl.where(entry != 0, penalised, x)
    x = x - freq * counts
    x = x - pres * (counts > 0).to(tl.float32)
    tl.store(dst_ptr + row * dst_stride + offs, x, mask=inside)


def update_state(state: torch.Tensor, recent: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
                 sampled: torch.Tensor) -> None:
    """Count each row's sampled token in its slot and push it into the slot's recent tokens, where weight
    ([num_reqs] int32) is 1 (rows that sample this step and own a slot); other rows (weight 0) write nothing.
    NOTE: not part of the sampler graph: a graph's warm-up run (SamplerGraphs) executes it once more than the
    step does, which would count a token twice; it runs right after the sampler (three small kernels)."""
    state.index_put_((slot, sampled.to(torch.int64)), weight.to(state.dtype), accumulate=True)
    old = recent.index_select(0, slot)  # [num_reqs, W]
    shifted = torch.cat([old[:, 1:], sampled.to(recent.dtype)[:, None]], dim=1)
    recent.index_copy_(0, slot, torch.where(weight[:, None] > 0, shifted, old))
