"""Sampler vs an independent float64 reference: kept sets, ties, greedy, seeding, frequencies, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

V = 600


def make_metadata(num_reqs: int, vocab_size: int = V, temperature: list[float] | None = None,
                  top_k: list[int | None] | None = None, top_p: list[float] | None = None,
                  min_p: list[float] | None = None, generators: dict[int, torch.Generator] | None = None,
                  max_num_logprobs: int | None = None, mask: bool = False) -> SamplingMetadata:
    temp = None if temperature is None else torch.tensor(temperature, dtype=torch.float32)
    greedy = [t <= 0 for t in temperature] if temperature is not None else [True] * num_reqs
    ks = None
    max_top_k = vocab_size
    if top_k is not None:
        ks = torch.tensor([vocab_size if k is None else k for k in top_k], dtype=torch.int32)
        max_top_k = int(ks.max())
    return SamplingMetadata(
        temperature=temp, all_greedy=all(greedy), all_random=not any(greedy),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=ks,
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        generators=generators or {}, max_num_logprobs=max_num_logprobs, max_top_k=max_top_k,
        sampling_mask_rows=torch.ones(num_reqs, dtype=torch.int32) if mask else None)


def reference_kept(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                   min_p: float | None) -> torch.Tensor:
    """Float64 reference of one row's support: min-p, then top-k (ties kept), then top-p (tie group kept)."""
    z = logits.double() / (temperature if temperature > 0 else 1.0)
    keep = torch.ones_like(z, dtype=torch.bool)
    if min_p:
        probs = z.softmax(-1)
        keep &= probs >= min_p * probs.max()
    if top_k is not None:
        kth = z.masked_fill(~keep, float("-inf")).sort(descending=True).values[top_k - 1]
        keep &= z >= kth
    if top_p is not None and top_p < 1.0:
        probs = z.masked_fill(~keep, float("-inf")).softmax(-1)
        ordered = probs.sort(descending=True).values
        last = int((ordered.cumsum(0) < top_p).sum())
        keep &= probs >= ordered[min(last, int(keep.sum()) - 1)]
    return keep


def check_kept(logits: torch.Tensor, temperature: list[float], top_k: list[int | None] | None,
               top_p: list[float] | None, min_p: list[float] | None) -> None:
    md = make_metadata(logits.shape[0], logits.shape[1], temperature, top_k, top_p, min_p)
    processed = Sampler.process_logits(logits, md)
    for r in range(logits.shape[0]):
        want = reference_kept(logits[r], temperature[r], None if top_k is None else top_k[r],
                              None if top_p is None else top_p[r], None if min_p is None else min_p[r])
        got = torch.isfinite(processed[r])
        assert torch.equal(got, want), (r, got.nonzero().flatten().tolist(), want.nonzero().flatten().tolist())
        scale = temperature[r] if temperature[r] > 0 else 1.0
        torch.testing.assert_close(processed[r][want], logits[r][want] / scale)


@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "k_p", "k_p_min_p", "mixed_disabled"])
def test_kept_sets_match_reference(case: str) -> None:
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    logits = torch.randn(6, V, generator=gen) * 3
    temperature = [1.0, 0.7, 1.3, 2.0, 0.5, 1.0]
    top_k = top_p = min_p = None
    if case in ("top_k", "k_p", "k_p_min_p"):
        top_k = [1, 5, 50, 17, 100, 2]
    if case in ("top_p", "k_p", "k_p_min_p"):
        top_p = [0.3, 0.9, 0.5, 0.99, 0.75, 0.6]
    if case in ("min_p", "k_p_min_p"):
        min_p = [0.1, 0.01, 0.3, 0.05, 0.5, 0.2]
    if case == "mixed_disabled":
        top_k, top_p, min_p = [None, 5, 30, None, 8, 600], [0.8, 1.0, 0.6, 0.9, 1.0, 0.7], [0.0, 0.1, 0, 0, 0, 0]
    check_kept(logits, temperature, top_k, top_p, min_p)


@pytest.mark.parametrize("partial", [False, True])
def test_boundary_ties(partial: bool) -> None:
    lower = -5.0 - torch.rand(4, V, generator=torch.Generator().manual_seed(0))
    logits = lower.clone()
    logits[0, :5] = torch.tensor([6.0, 5.0, 4.0, 4.0, 4.0])  # k=3: ties at the k-th value kept
    logits[1, :5] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0])  # k=2, p=0.5: mass of the 4 tied survivors counts
    logits[2, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0])  # p reached inside the tie group: whole group kept
    logits[2, 5:] = -20.0
    logits[3, 10:14] = 1.5  # min-p ties: all four or none
    # partial: every row has top_k, so the candidates come from torch.topk(max_top_k) instead of a sort.
    top_k = [3, 2, 3, 3] if partial else [3, 2, None, None]
    top_p = [1.0, 0.5, 0.5, 1.0]
    min_p = [0.0, 0.0, 0.0, 0.5]
    check_kept(logits, [1.0] * 4, top_k, top_p, min_p)
    md = make_metadata(4, V, [1.0] * 4, top_k, top_p, min_p)
    assert (md.max_top_k < V) == partial
    processed = Sampler.process_logits(logits, md)
    kept = [torch.isfinite(processed[r]).nonzero().flatten().tolist() for r in range(4)]
    assert kept[0] == [0, 1, 2, 3, 4]
    assert kept[1] == [0, 1, 2, 3, 4]
    assert kept[2] == [0, 1, 2, 3]
    assert kept[3] == [10, 11, 12, 13]


def test_greedy_is_argmax_of_raw_logits() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    md = make_metadata(5, V, [0.0, 0.8, 0.0, 1.0, 0.0], top_k=[3, 3, 3, 3, 3], top_p=[0.5] * 5)
    out = Sampler()(logits, md)
    want = logits.double().argmax(-1)
    for r in (0, 2, 4):
        assert int(out.sampled_token_ids[r]) == int(want[r])
    all_greedy = Sampler()(logits, make_metadata(5, V))
    assert torch.equal(all_greedy.sampled_token_ids, want)
    assert all_greedy.sampled_token_ids.dtype == torch.int64


def test_seeded_rows_are_batch_independent() -> None:
    row = torch.randn(V, generator=torch.Generator().manual_seed(2))

    def run(batch: torch.Tensor, seeded_row: int) -> list[int]:
        gen = torch.Generator().manual_seed(1234)
        n = batch.shape[0]
        tokens = []
        for _ in range(8):
            md = make_metadata(n, V, [1.0] * n, top_k=[50] * n, top_p=[0.95] * n, generators={seeded_row: gen})
            tokens.append(int(Sampler()(batch, md).sampled_token_ids[seeded_row]))
        return tokens

    others = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    alone = run(row[None], 0)
    assert run(torch.stack([others[0], row]), 1) == alone
    assert run(torch.stack([row, others[1], others[2]]), 0) == alone
    assert len(set(alone)) > 1  # the draws do vary from step to step


def test_sampling_frequencies_match_probabilities() -> None:
    torch.manual_seed(0)
    base = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.3, -1.0, -2.0, -3.0])
    n = 20000
    md = make_metadata(n, 8, [0.9] * n, top_k=[6] * n, top_p=[0.9] * n)
    out = Sampler()(base.expand(n, 8).contiguous(), md)
    counts = np.bincount(out.sampled_token_ids.numpy(), minlength=8)
    keep = reference_kept(base, 0.9, 6, 0.9, None)
    probs = (base.double() / 0.9).masked_fill(~keep, float("-inf")).softmax(-1).numpy()
    assert counts[~keep.numpy()].sum() == 0
    expected = probs[keep.numpy()] * n
    chi2 = float((((counts[keep.numpy()] - expected) ** 2) / expected).sum())
    assert chi2 < 30.0, (counts, expected)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes(mode: str) -> None:
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(4)) * 2
    temperature, top_k, top_p = [0.7, 1.0, 1.5, 0.0], [20, 5, 600, 40], [0.9, 1.0, 0.8, 0.7]
    md = make_metadata(4, V, temperature, top_k, top_p, max_num_logprobs=3)
    out = Sampler(mode)(logits, md)
    lt = out.logprobs_tensors
    assert lt is not None and lt.logprob_token_ids.shape == (4, 4)
    for r in range(4):
        raw = logits[r].double()
        keep = reference_kept(logits[r], temperature[r], top_k[r], top_p[r], None)
        processed = (raw / (temperature[r] or 1.0)).masked_fill(~keep, float("-inf"))
        ref = {"raw_logprobs": raw.log_softmax(-1), "raw_logits": raw,
               "processed_logprobs": processed.log_softmax(-1), "processed_logits": processed}[mode]
        tok = int(out.sampled_token_ids[r])
        assert keep[tok]
        assert int(lt.logprob_token_ids[r, 0]) == tok
        assert int(lt.selected_token_ranks[r]) == 1 + int((ref > ref[tok]).sum())
        top = ref.topk(3).indices.tolist()
        assert lt.logprob_token_ids[r, 1:].tolist() == top
        torch.testing.assert_close(lt.logprobs[r].double(), ref[[tok] + top], atol=1e-5, rtol=1e-5)
        if mode == "processed_logprobs":
            assert abs(float(ref[keep].exp().sum()) - 1.0) < 1e-9


def test_sampled_token_inside_mask() -> None:
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(5))
    md = make_metadata(5, V, [1.0, 0.5, 2.0, 1.0, 0.8], top_k=[1, 4, 64, 300, 7], top_p=[1.0, 0.9, 0.7, 0.95, 0.5],
                       mask=True)
    out = Sampler("processed_logprobs")(logits, md)
    assert out.sampling_mask is not None
    lists = out.sampling_mask.tolists()
    for r in range(5):
        support = lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]]
        assert int(out.sampled_token_ids[r]) in support.tolist()


def test_invalid_logprobs_mode() -> None:
    with pytest.raises(ValueError, match="logprobs_mode"):
        Sampler("normalized")
