"""Truncation filters on float32 logits (already divided by temperature): min-p, then top-k, then top-p.

Every filter writes -inf, in place, into the logits it removes; what stays finite is the row's support.

Rules (all independent of token id order):
- min-p keeps token i when p_i >= min_p * max_j p_j, evaluated as exp(z_i - max z) >= min_p (no normalisation,
  so tokens with equal logits always get the same decision). min_p == 0 disables it.
- top-k keeps every token whose logit is >= the row's k-th largest logit, so ties at the boundary are all kept
  and the support can be larger than k. k >= vocab_size disables it.
- top-p works on the top-k survivors: sort them by probability (descending), find the first position where
  the running mass reaches p; the token there is the last kept one and **every survivor whose probability is
  >= that token's probability is kept** (the whole tie group at the boundary, never a part of it). If rounding
  leaves the mass just short of p, every survivor is kept. p >= 1 disables it.

Cost: when a row limits top_k, the batch runs `torch.topk` with k = max_top_k (the largest top_k of the batch)
instead of sorting the vocabulary, and top-p runs on those candidates only. Survivors beyond the candidates
can only be ties with the last candidate; they are counted with one compare over the row and enter the top-p
mass with the threshold's probability. Without top_k (or when some row has none, so max_top_k == vocab_size),
top-p falls back to a full descending sort of the row.
"""

from __future__ import annotations

import torch

from vllm.sampling_params import _SAMPLING_EPS as SAMPLING_EPS

_NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, temperature: torch.Tensor | None, min_p: torch.Tensor | None,
                   top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int) -> torch.Tensor:
    """Temperature (values below SAMPLING_EPS count as 1.0), min-p, top-k, top-p on a copy of `logits`
    ([num_reqs, V] float32) -> the processed logits."""
    if temperature is None:
        processed = logits.clone()
    else:
        temperature = temperature.to(torch.float32)
        temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        processed = logits / temperature[:, None]
    if min_p is not None:
        apply_min_p(processed, min_p)
    apply_top_k_top_p(processed, top_k, top_p, max_top_k)
    return processed


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """logits: [num_reqs, V] float32, in place; min_p: [num_reqs] float32 (0 where disabled)."""
    row_max = logits.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
    relative = (logits - row_max).exp_()  # [num_reqs, V] = p_i / p_max
    logits.masked_fill_(relative < min_p.to(logits.dtype)[:, None], _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int) -> None:
    """logits: [num_reqs, V] float32, in place. top_k: [num_reqs] int (V where disabled) or None; top_p:
    [num_reqs] float32 (1.0 where disabled) or None. max_top_k: the batch's largest top_k (host int)."""
    if top_k is None and top_p is None:
        return
    vocab_size = logits.shape[1]
    if top_k is not None and 0 < max_top_k < vocab_size:
        # [num_reqs, C] descending values and their ids, C = max_top_k.
        cand_vals, _ = logits.topk(max_top_k, dim=-1, sorted=True)
        partial = True
    else:
        cand_vals, _ = logits.sort(dim=-1, descending=True)  # [num_reqs, V]
        partial = False
    num_cand = cand_vals.shape[1]

    if top_k is not None:
        k = top_k.to(device=logits.device, dtype=torch.long).clamp(1, vocab_size)  # [num_reqs]
        kth = cand_vals.gather(1, (k - 1).clamp(max=num_cand - 1)[:, None])  # [num_reqs, 1]
        kth = torch.where(k[:, None] >= vocab_size, _NEG_INF, kth)
        logits.masked_fill_(logits < kth, _NEG_INF)
        cand_vals = cand_vals.masked_fill(cand_vals < kth, _NEG_INF)

    if top_p is None:
        return
    p = top_p.to(device=logits.device, dtype=torch.float32)[:, None]  # [num_reqs, 1]
    num_extra = None
    if partial:
        # NOTE: survivors outside the candidates can only be ties at a finite top-k threshold.
        num_finite = (cand_vals > _NEG_INF).sum(dim=-1, keepdim=True)  # [num_reqs, 1]
        num_survivors = (logits >= kth).sum(dim=-1, keepdim=True)
        num_extra = torch.where(kth > _NEG_INF, num_survivors - num_finite, 0)
    cut_val = top_p_cut_value(cand_vals, p, kth if partial else None, num_extra)
    logits.masked_fill_(logits < cut_val, _NEG_INF)


def top_p_cut_value(cand_vals: torch.Tensor, p: torch.Tensor, kth: torch.Tensor | None,
                    num_extra: torch.Tensor | None) -> torch.Tensor:
    """The top-p threshold of each row: the logit of the last kept token (-inf where p >= 1).

    cand_vals: [num_reqs, C] float32, descending, -inf for removed candidates; p: [num_reqs, 1] float32.
    num_extra ([num_reqs, 1]): survivors not among the candidates, each a tie at `kth` ([num_reqs, 1]).
    Shared by the general and the fast path so that both do bitwise the same arithmetic.
    """
    row_max = cand_vals[:, :1]  # [num_reqs, 1]
    weights = (cand_vals - row_max).exp_()  # [num_reqs, C], 0 for removed candidates
    denom = weights.sum(dim=-1, keepdim=True)  # [num_reqs, 1]
    num_finite = (cand_vals > _NEG_INF).sum(dim=-1, keepdim=True)  # [num_reqs, 1]
    if num_extra is not None and kth is not None:
        denom = denom + num_extra * (kth - row_max).exp()
    cum_probs = (weights / denom).cumsum_(dim=-1)  # [num_reqs, C]
    cut = (cum_probs < p).sum(dim=-1, keepdim=True).clamp_(max=num_finite - 1).clamp_(min=0)
    cut_val = cand_vals.gather(1, cut)  # [num_reqs, 1] logit of the last kept token
    return torch.where(p >= 1.0, _NEG_INF, cut_val)
