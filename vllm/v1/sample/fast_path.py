"""The sampler's fast path: every filter, the draw, the logprobs and the sampling mask on top-k candidates.

Role: when every row limits top_k (0 < max_top_k < V, max_top_k <= MAX_COMPACT_SUPPORT), the radix select
(ops/topk_select.py) gives each row the ids z >= its k-th largest z = logits / temperature in ascending id
order; temperature, min-p, top-p, the exponential race, processed logprobs and the support are computed on
that [num_reqs, C] buffer only, so no full-vocabulary sort, softmax, race or compaction pass runs.

Invariants (the same results as the general path, Sampler.process_logits + random_sample + compaction):
- Kept sets: min-p keeps a prefix of the sorted row, so top-k after min-p keeps exactly the min-p survivors
  among the candidates; top-p uses ops/topk_topp.top_p_cut_value on the same [num_reqs, max_top_k]
  descending values (and the same count of extra ties) as the general path, so the cut is bitwise the same.
- Seeded rows draw exactly one V-sized `exponential_` from their generator per step and read it at the
  candidate ids, so argmax over candidates of p_i / q_i is the full-vocabulary race. Unseeded rows draw C
  numbers from the default generator.
- Rows the buffer cannot hold exactly (select counts == -1: ties past C, NaN/+inf, a -inf threshold) are
  recomputed by the general path, reusing the seeded rows' draws, without a host sync: the flagged rows are
  sorted first on the device and the general path runs on a fixed MAX_FALLBACK_ROWS rows, whose results
  replace the fast ones only where a row is flagged. So the step never waits for the GPU (async scheduling
  keeps its overlap). NOTE: a step with more than MAX_FALLBACK_ROWS flagged rows would leave the excess rows
  with their fast-path results; with C = max_top_k + max(64, max_top_k / 4) slots that takes more than 64
  exact ties at the k-th value in each of 9+ rows of one step, or NaN/+inf logits in 9+ rows.
- Mask rows whose support exceeds K get their bitmask row from the kept candidates (no sync); the bitmask
  rows of the other rows are undefined (tolists() reads only overflow rows). K is the candidate width C
  unless C > MAX_COMPACT_SUPPORT, so in the common case no row can overflow and no bitmask is built at all.
"""

from __future__ import annotations

import torch

from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.logprobs import gather_logprobs
from vllm.v1.sample.ops.mask_compaction import compact_candidates
from vllm.v1.sample.ops.topk_select import select_top_k_candidates
from vllm.v1.sample.ops.topk_topp import SAMPLING_EPS, process_logits, top_p_cut_value
from vllm.v1.sample.sampling_mask import (MAX_COMPACT_SUPPORT, SamplingMaskTensors, compact_sampling_mask_into,
                                          merge_rows)

_NEG_INF = float("-inf")
MAX_FALLBACK_ROWS = 8


def fast_path_applies(md: SamplingMetadata, vocab_size: int) -> bool:
    return md.top_k is not None and 0 < md.max_top_k < vocab_size and md.max_top_k <= MAX_COMPACT_SUPPORT


def num_candidates(md: SamplingMetadata, vocab_size: int) -> int:
    """Buffer width C: max_top_k plus room for ties at the threshold, at least the logprobs' N."""
    slack = max(64, md.max_top_k // 4)
    return min(vocab_size, max(md.max_top_k + slack, md.max_num_logprobs or 0))


def sample_fast(logits: torch.Tensor, md: SamplingMetadata, logprobs_mode: str,
                raw_values: torch.Tensor | None,
                ) -> tuple[torch.Tensor, LogprobsTensors | None, SamplingMaskTensors | None]:
    """logits: [num_reqs, V] float32, bf16 or fp16 (read as their exact float32 values) -> (sampled [num_reqs]
    int64, logprobs, mask); see the module docstring.

    raw_values: the full-vocabulary values of the raw logprobs modes (None in the processed modes).
    """
    assert md.top_k is not None
    num_reqs, vocab_size = logits.shape
    device = logits.device
    if md.temperature is None:
        temperature = torch.ones(num_reqs, dtype=torch.float32, device=device)
    else:
        temperature = md.temperature.to(device=device, dtype=torch.float32)
    greedy_rows = temperature < SAMPLING_EPS  # [num_reqs] bool
    temperature = torch.where(greedy_rows, 1.0, temperature)

    num_cand = num_candidates(md, vocab_size)
    cand = select_top_k_candidates(logits, temperature, md.top_k, num_cand)
    fallback = cand.counts < 0  # [num_reqs] bool
    count = cand.counts.clamp(min=0)  # [num_reqs]
    valid = torch.arange(num_cand, device=device)[None, :] < count[:, None]  # [num_reqs, C]
    ids = torch.where(valid, cand.token_ids, 0)  # [num_reqs, C] int32
    vals = torch.where(valid, cand.values, _NEG_INF)  # [num_reqs, C] float32, processed logits

    if md.min_p is not None:
        row_max = vals.amax(dim=-1, keepdim=True)  # [num_reqs, 1]
        min_p = md.min_p.to(device=device, dtype=torch.float32)[:, None]
        vals = vals.masked_fill((vals - row_max).exp() < min_p, _NEG_INF)
    if md.top_p is not None:
        vals = _apply_top_p(vals, cand.kth, md)

    sampled, seeded_draws = _race(vals, ids, md, greedy_rows, logits)
    tok_slot = ((ids == sampled[:, None]) & (vals > _NEG_INF)).to(torch.int32).argmax(dim=-1)  # [num_reqs]

    logprobs = None
    if md.max_num_logprobs is not None:
        if raw_values is not None:
            logprobs = gather_logprobs(raw_values, md.max_num_logprobs, sampled)
        else:
            values = vals.log_softmax(dim=-1) if logprobs_mode == "processed_logprobs" else vals
            logprobs = _candidate_logprobs(values, ids, tok_slot, sampled, md.max_num_logprobs)

    mask = None
    if md.sampling_mask_rows is not None:
        mask = _candidate_mask(vals, ids, md.sampling_mask_rows, vocab_size)
    _general_rows(logits, md, logprobs_mode, raw_values, fallback, seeded_draws, sampled, logprobs, mask)
    return sampled, logprobs, mask


def _apply_top_p(vals: torch.Tensor, kth: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    assert md.top_k is not None and md.top_p is not None
    device = vals.device
    k = md.top_k.to(device=device, dtype=torch.long)[:, None]  # [num_reqs, 1]
    num_survivors = (vals > _NEG_INF).sum(dim=-1, keepdim=True)  # [num_reqs, 1]
    # NOTE: the general path's threshold after min-p: the k-th survivor, or -inf when fewer than k survive.
    kth_gen = torch.where(num_survivors >= k, kth[:, None], _NEG_INF)  # [num_reqs, 1]
    desc = vals.sort(dim=-1, descending=True).values[:, :md.max_top_k].contiguous()  # [num_reqs, max_top_k]
    num_finite = (desc > _NEG_INF).sum(dim=-1, keepdim=True)
    num_extra = torch.where(kth_gen > _NEG_INF, num_survivors - num_finite, 0)
    p = md.top_p.to(device=device, dtype=torch.float32)[:, None]
    cut_val = top_p_cut_value(desc, p, kth_gen, num_extra)  # [num_reqs, 1]
    return vals.masked_fill(vals < cut_val, _NEG_INF)


def _race(vals: torch.Tensor, ids: torch.Tensor, md: SamplingMetadata, greedy_rows: torch.Tensor,
          logits: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """Exponential race over the kept candidates -> ([num_reqs] int64 tokens, row -> its [V] seeded draw)."""
    num_reqs, vocab_size = logits.shape
    seeded_draws: dict[int, torch.Tensor] = {}
    if md.all_greedy:
        return logits.argmax(dim=-1), seeded_draws
    probs = vals.softmax(dim=-1)  # [num_reqs, C]
    q = torch.empty_like(probs)  # [num_reqs, C]
    if len(md.generators) < num_reqs:
        q.exponential_()
    for row, generator in md.generators.items():
        draw = torch.empty(vocab_size, dtype=torch.float32, device=logits.device)  # [V]
        draw.exponential_(generator=generator)
        seeded_draws[row] = draw
        q[row] = draw[ids[row].long()]
    # NOTE: a draw of exactly 0 would make 0/0 = NaN win the argmax for a removed token.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    slot = probs.div_(q).argmax(dim=-1, keepdim=True)  # [num_reqs, 1]
    sampled = ids.gather(1, slot).squeeze(1).to(torch.int64)
    if not md.all_random and md.temperature is not None:
        sampled = torch.where(greedy_rows, logits.argmax(dim=-1), sampled)
    return sampled, seeded_draws


def _candidate_logprobs(values: torch.Tensor, ids: torch.Tensor, tok_slot: torch.Tensor, sampled: torch.Tensor,
                        num_logprobs: int) -> LogprobsTensors:
    """Same layout as ops/logprobs.gather_logprobs; every value outside the candidates is -inf."""
    sampled_values = values.gather(1, tok_slot[:, None])  # [num_reqs, 1]
    ranks = (values > sampled_values).sum(dim=-1).add_(1)  # [num_reqs]
    token_ids = sampled[:, None]
    if num_logprobs > 0:
        top_values, top_slots = values.topk(num_logprobs, dim=-1)  # [num_reqs, N]
        token_ids = torch.cat([token_ids, ids.gather(1, top_slots).to(torch.int64)], dim=1)
        sampled_values = torch.cat([sampled_values, top_values], dim=1)
    return LogprobsTensors(token_ids.to(torch.int32), sampled_values.to(torch.float32), ranks.to(torch.int32))


def _candidate_mask(vals: torch.Tensor, ids: torch.Tensor, mask_rows: torch.Tensor,
                    vocab_size: int) -> SamplingMaskTensors:
    """The support is the kept candidates (vals > -inf), already ascending: compact them into [num_reqs, K]."""
    num_reqs = vals.shape[0]
    # NOTE: K is the candidate width C (max_top_k plus the tie slack), not max_top_k: every kept id is a
    # candidate, so boundary ties never overflow to the bitmask on this path (beyond upstream, which sizes K
    # by top_k and sends every boundary tie through the bitmask).
    num_kept = min(ids.shape[1], vocab_size, MAX_COMPACT_SUPPORT)
    token_ids, counts = compact_candidates(vals, ids, mask_rows, num_kept)
    num_bytes = (vocab_size + 7) // 8
    if num_kept >= ids.shape[1]:
        # K holds every candidate, so no row overflows: the bitmask is never read (SamplingMaskTensors reads
        # only rows past K, and the general path writes whole rows for the rows it recomputes).
        packed_mask = torch.empty((num_reqs, num_bytes), dtype=torch.uint8, device=ids.device)
        return SamplingMaskTensors(token_ids, packed_mask, counts, vocab_size)
    # NOTE: bitmask rows only for rows past K, without a host sync: distinct bits of one int32 word add up to
    # their OR, and the little-endian bytes of word w are tokens 32w..32w+31 in little bit order.
    kept = (vals > _NEG_INF) & (mask_rows.to(ids.device) > 0)[:, None]  # [num_reqs, C] bool
    overflow = kept & (counts > num_kept)[:, None]  # [num_reqs, C] bool
    words = torch.zeros((num_reqs, (vocab_size + 31) // 32), dtype=torch.int32, device=ids.device)
    bits = torch.where(overflow, torch.ones_like(ids) << (ids & 31), 0)  # [num_reqs, C] int32
    words.scatter_add_(1, (ids >> 5).to(torch.long), bits)
    packed_mask = words.view(torch.uint8)[:, :num_bytes]  # [num_reqs, ceil(V/8)] uint8
    return SamplingMaskTensors(token_ids, packed_mask, counts, vocab_size)


def _general_rows(logits: torch.Tensor, md: SamplingMetadata, logprobs_mode: str, raw_values: torch.Tensor | None,
                  fallback: torch.Tensor, seeded_draws: dict[int, torch.Tensor], sampled: torch.Tensor,
                  logprobs: LogprobsTensors | None, mask: SamplingMaskTensors | None) -> None:
    """Recompute the flagged rows (fallback: [num_reqs] bool) with the general full-vocabulary path and write them
    into the outputs in place, on MAX_FALLBACK_ROWS device-chosen rows, with no host sync."""
    device = logits.device
    num_reqs, vocab_size = logits.shape
    n = min(num_reqs, MAX_FALLBACK_ROWS)
    index = torch.argsort((~fallback).to(torch.int8), stable=True)[:n]  # [n] flagged rows first
    hit = fallback[index]  # [n] bool
    sub = logits[index].to(torch.float32)  # [n, V]

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)[index]

    def merge(dst: torch.Tensor, src: torch.Tensor) -> None:
        merge_rows(dst, src, index, hit)

    temperature = pick(md.temperature)
    processed = process_logits(sub, temperature, pick(md.min_p), pick(md.top_k), pick(md.top_p), md.max_top_k)
    if md.all_greedy:
        tokens = sub.argmax(dim=-1)
    else:
        probs = processed.softmax(dim=-1)  # [n, V]
        q = torch.empty_like(probs).exponential_()
        if seeded_draws:
            rows = list(seeded_draws)
            slot_of_row = torch.full((num_reqs,), -1, dtype=torch.long)
            slot_of_row[rows] = torch.arange(len(rows))
            slot = slot_of_row.to(device)[index]  # [n], -1 for unseeded rows
            draws = torch.stack([seeded_draws[r] for r in rows])  # [num_seeded, V]
            q = torch.where((slot >= 0)[:, None], draws[slot.clamp(min=0)], q)
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        tokens = probs.div_(q).argmax(dim=-1)
        if temperature is not None and not md.all_random:
            tokens = torch.where(temperature < SAMPLING_EPS, sub.argmax(dim=-1), tokens)
    merge(sampled, tokens)
    if logprobs is not None and md.max_num_logprobs is not None:
        if raw_values is not None:
            values = raw_values[index]
        else:
            values = processed.log_softmax(dim=-1) if logprobs_mode == "processed_logprobs" else processed
        for dst, src in zip(logprobs, gather_logprobs(values, md.max_num_logprobs, tokens)):
            merge(dst, src)
    if mask is not None and md.sampling_mask_rows is not None:
        compact_sampling_mask_into(processed, md.sampling_mask_rows, mask, index, hit)
