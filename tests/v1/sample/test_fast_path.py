"""Fast top-k path (radix select + work on candidates) vs the general full-vocabulary path and float64 refs.

Every row is seeded, so the fast and the general path must sample the very same tokens; kept sets come back
through the sampling mask and are compared with the float64 reference of test_sampler.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from test_sampler import make_metadata, reference_kept

from vllm.v1.sample import fast_path
from vllm.v1.sample.fast_path import num_candidates
from vllm.v1.sample.ops.topk_select import select_top_k_candidates
from vllm.v1.sample.sampler import Sampler

V = 3001
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def supports(out) -> list[list[int]]:
    lists = out.sampling_mask.to_cpu_nonblocking().tolists()
    return [lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]].tolist() for r in range(len(lists.offsets) - 1)]


def run_both(logits: torch.Tensor, temperature: list[float], top_k: list[int], top_p: list[float] | None,
             min_p: list[float] | None, mode: str = "processed_logprobs", steps: int = 2, mask_rows=None):
    """Run the fast and the general sampler on the same seeds for `steps` steps; return both outputs."""
    n = logits.shape[0]
    results = []
    for fast in (True, False):
        gens = {r: torch.Generator(device=DEVICE).manual_seed(100 + r) for r in range(n)}
        outs = []
        for _ in range(steps):
            md = make_metadata(n, logits.shape[1], temperature, top_k, top_p, min_p, generators=gens,
                               max_num_logprobs=2, mask=True)
            md = _to_device(md)
            if mask_rows is not None:
                md.sampling_mask_rows = torch.tensor(mask_rows, dtype=torch.int32, device=DEVICE)
            outs.append(Sampler(mode, use_fast_path=fast)(logits.to(DEVICE), md))
        results.append((outs, [g.get_state() for g in gens.values()]))
    return results


def _to_device(md):
    for name in ("temperature", "top_p", "top_k", "min_p", "sampling_mask_rows"):
        value = getattr(md, name)
        if value is not None:
            setattr(md, name, value.to(DEVICE))
    return md


def check_same(logits, temperature, top_k, top_p, min_p, mode="processed_logprobs", mask_rows=None):
    (fast, fast_states), (general, general_states) = run_both(logits, temperature, top_k, top_p, min_p, mode,
                                                              mask_rows=mask_rows)
    for a, b in zip(fast_states, general_states):
        assert torch.equal(a, b)  # the generators advanced by the same amount
    for f, g in zip(fast, general):
        assert f.sampled_token_ids.tolist() == g.sampled_token_ids.tolist()
        assert supports(f) == supports(g)
        fl, gl = f.logprobs_tensors, g.logprobs_tensors
        assert fl.logprob_token_ids[:, 0].tolist() == gl.logprob_token_ids[:, 0].tolist()
        assert fl.selected_token_ranks.tolist() == gl.selected_token_ranks.tolist()
        torch.testing.assert_close(fl.logprobs.cpu(), gl.logprobs.cpu(), atol=1e-5, rtol=1e-5)
        # Top-N ids may differ only inside groups of equal values.
        torch.testing.assert_close(fl.logprobs[:, 1:].cpu(), gl.logprobs[:, 1:].cpu(), atol=1e-5, rtol=1e-5)
    for r, got in enumerate(supports(fast[0])):
        if mask_rows is not None and mask_rows[r] == 0:
            assert got == []
            continue
        want = reference_kept(logits[r], temperature[r], top_k[r], None if top_p is None else top_p[r],
                              None if min_p is None else min_p[r])
        assert got == want.nonzero().flatten().tolist(), r
        assert int(fast[0].sampled_token_ids[r]) in got
    return fast


def bf16_logits(num_reqs: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    # NOTE: bf16-rounded values make ties common, like a real model's logits.
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_reqs, V, generator=gen) * scale).to(torch.bfloat16).float()


@pytest.fixture(params=["triton", "torch"])
def select_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both candidate selectors: the Triton kernel (interpreted on CPU) and the torch version."""
    use_triton = request.param == "triton"
    monkeypatch.setattr(fast_path, "select_top_k_candidates",
                        functools.partial(select_top_k_candidates, use_triton=use_triton))
    return use_triton


def test_select_kernel_matches_topk_threshold(select_impl: bool) -> None:
    logits = bf16_logits(5, 0)
    logits[1] = -logits[1].abs()
    logits[2, :40] = 0.0
    logits[2, 40:80] = -0.0  # -0.0 ties +0.0
    logits[2, 80:] = -1.0 - logits[2, 80:].abs()
    logits[3] = logits[3].round()
    temperature = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.3])
    top_k = torch.tensor([1, 50, 60, 30, 200], dtype=torch.int32)
    cand = select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), 400, select_impl)
    z = logits / temperature[:, None]
    for r in range(5):
        kth = z[r].topk(int(top_k[r])).values[-1]
        want = (z[r] >= kth).nonzero().flatten()
        n = int(cand.counts[r])
        assert n == len(want) and float(cand.kth[r]) == float(kth)
        assert torch.equal(cand.token_ids[r, :n].cpu().long(), want)
        assert torch.equal(cand.values[r, :n].cpu(), z[r, want])


def test_select_kernel_flags_rows_it_cannot_hold(select_impl: bool) -> None:
    logits = bf16_logits(4, 1)
    logits[0, 7] = float("nan")
    logits[1, 9] = float("inf")
    logits[2, :] = float("-inf")
    logits[2, :3] = 1.0  # fewer than k finite: the threshold is -inf
    logits[3, :500] = 20.0  # 500 ties at the threshold > C
    cand = select_top_k_candidates(logits.to(DEVICE), torch.ones(4, device=DEVICE),
                                   torch.full((4,), 10, dtype=torch.int32, device=DEVICE), 100, select_impl)
    assert cand.counts.tolist() == [-1, -1, -1, -1]


@pytest.mark.parametrize("case", ["k", "k_p", "k_p_min_p", "mixed"])
def test_fast_path_matches_general_and_reference(case: str, select_impl: bool) -> None:
    logits = bf16_logits(6, 2 + len(case))
    temperature = [1.0, 0.7, 1.3, 2.0, 0.5, 1.0]
    top_k = {"k": [1, 5, 50, 17, 100, 2], "mixed": [3, 40, 1, 200, 12, 7]}.get(case, [20, 64, 300, 5, 8, 150])
    top_p = None if case == "k" else [0.3, 0.9, 0.5, 0.99, 0.75, 1.0]
    min_p = [0.1, 0.01, 0.3, 0.0, 0.5, 0.2] if case in ("k_p_min_p", "mixed") else None
    check_same(logits, temperature, top_k, top_p, min_p)


def test_boundary_ties_and_greedy_rows(select_impl: bool) -> None:
    lower = -5.0 - torch.rand(5, V, generator=torch.Generator().manual_seed(0))
    logits = lower.clone()
    logits[0, :5] = torch.tensor([6.0, 5.0, 4.0, 4.0, 4.0])  # k=3: ties at the k-th value kept
    logits[1, :5] = torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0])  # k=2, p=0.5: mass of the 4 tied survivors counts
    logits[2, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 0.0])  # p reached inside the tie group: group kept
    logits[2, 5:] = -20.0
    logits[3, 10:14] = 1.5  # min-p ties: all four or none
    logits[4, 100:110] = 3.0  # greedy row with ties at the max
    fast = check_same(logits, [1.0, 1.0, 1.0, 1.0, 0.0], [3, 2, 3, 3, 4], [1.0, 0.5, 0.5, 1.0, 0.9],
                      [0.0, 0.0, 0.0, 0.5, 0.0])
    got = supports(fast[0])
    assert got[:4] == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3], [10, 11, 12, 13]]
    assert int(fast[0].sampled_token_ids[4]) == 100


def test_overflow_rows_take_the_exact_general_path(select_impl: bool) -> None:
    logits = bf16_logits(6, 3)
    logits[0, 200:260] = 30.0  # 60 ties at the top, k=8: past C -> general path, support past K
    logits[1, 7] = float("nan")  # non-finite rows -> general path
    logits[2, 100:400:3] = 25.0  # 100 ties, k=50, p=1: support 100 > K (bitmask), within C
    logits[3, 11] = float("inf")
    md_top_k = [8, 20, 50, 20, 30, 40]
    assert num_candidates(make_metadata(6, V, top_k=md_top_k), V) < 100 + 64 - 50 + 60
    top_p = [1.0, 0.9, 1.0, 0.9, 0.8, 0.95]
    (fast, _), (general, _) = run_both(logits, [1.0] * 6, md_top_k, top_p, None)
    for f, g in zip(fast, general):
        assert f.sampled_token_ids.tolist() == g.sampled_token_ids.tolist()
        assert supports(f) == supports(g)
        torch.testing.assert_close(f.logprobs_tensors.logprobs[:, 0].cpu(), g.logprobs_tensors.logprobs[:, 0].cpu(),
                                   atol=1e-5, rtol=1e-5, equal_nan=True)
    got = supports(fast[0])
    assert got[0] == list(range(200, 260))
    assert got[2] == list(range(100, 400, 3))
    counts = fast[0].sampling_mask.counts.tolist()
    assert counts[0] == 60 and counts[2] == 100  # both past K = 50
    for r in (0, 2, 4, 5):
        want = reference_kept(logits[r], 1.0, md_top_k[r], top_p[r], None)
        assert got[r] == want.nonzero().flatten().tolist()


def test_rows_without_mask_are_empty_and_mask_off_gives_same_tokens(select_impl: bool) -> None:
    logits = bf16_logits(4, 4)
    temperature, top_k, top_p = [1.0, 0.9, 1.1, 1.0], [30, 10, 60, 5], [0.95, 0.8, 0.9, 0.5]
    check_same(logits, temperature, top_k, top_p, None, mask_rows=[1, 0, 1, 0])
    gens = {r: torch.Generator(device=DEVICE).manual_seed(7 + r) for r in range(4)}
    md = _to_device(make_metadata(4, V, temperature, top_k, top_p, generators=gens, max_num_logprobs=1, mask=True))
    with_mask = Sampler("processed_logprobs")(logits.to(DEVICE), md).sampled_token_ids.tolist()
    gens = {r: torch.Generator(device=DEVICE).manual_seed(7 + r) for r in range(4)}
    md = _to_device(make_metadata(4, V, temperature, top_k, top_p, generators=gens, max_num_logprobs=1))
    out = Sampler("processed_logprobs")(logits.to(DEVICE), md)
    assert out.sampling_mask is None and out.sampled_token_ids.tolist() == with_mask


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logits"])
def test_other_logprobs_modes(mode: str, select_impl: bool) -> None:
    logits = bf16_logits(3, 5)
    check_same(logits, [0.8, 1.0, 1.5], [10, 40, 3], [0.9, 0.7, 1.0], None, mode=mode)


def test_seeded_row_independent_of_batch_on_fast_path() -> None:
    row = bf16_logits(1, 6)[0]
    others = bf16_logits(3, 7)

    def run(batch: torch.Tensor, seeded_row: int) -> list[int]:
        gen = torch.Generator(device=DEVICE).manual_seed(1234)
        n = batch.shape[0]
        tokens = []
        for _ in range(6):
            md = _to_device(make_metadata(n, V, [1.0] * n, top_k=[50] * n, top_p=[0.95] * n,
                                          generators={seeded_row: gen}))
            tokens.append(int(Sampler()(batch.to(DEVICE), md).sampled_token_ids[seeded_row]))
        return tokens

    alone = run(row[None], 0)
    assert run(torch.stack([others[0], row]), 1) == alone
    assert run(torch.stack([row, others[1], others[2]]), 0) == alone
    assert len(set(alone)) > 1


def test_unseeded_frequencies_match_probabilities() -> None:
    torch.manual_seed(0)
    base = torch.full((V,), -30.0)
    base[[5, 900, 901, 2000, 3000]] = torch.tensor([1.0, 0.5, 0.2, 0.0, -0.3])
    n = 4000
    md = _to_device(make_metadata(n, V, [0.9] * n, top_k=[4] * n, top_p=[0.95] * n))
    out = Sampler()(base.expand(n, V).contiguous().to(DEVICE), md)
    keep = reference_kept(base, 0.9, 4, 0.95, None)
    probs = (base.double() / 0.9).masked_fill(~keep, float("-inf")).softmax(-1).numpy()
    counts = np.bincount(out.sampled_token_ids.cpu().numpy(), minlength=V)
    assert counts[~keep.numpy()].sum() == 0
    expected = probs[keep.numpy()] * n
    chi2 = float((((counts[keep.numpy()] - expected) ** 2) / expected).sum())
    assert chi2 < 25.0, (counts[keep.numpy()], expected)


def test_select_falls_back_to_torch_when_the_kernel_cannot_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    from vllm.v1.sample.ops import topk_select

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise triton.CompilationError("src", None, "cannot compile")

    # NOTE: the select's entry (the prefilter) fails to compile; the tensors stay on the CPU, which a compiled kernel
    # (no TRITON_INTERPRET, e.g. on a GPU machine) could not read anyway.
    monkeypatch.setattr(topk_select, "_select_prefilter", broken)
    monkeypatch.setattr(topk_select, "_kernel_failed", False)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 300, generator=gen)
    temperature = torch.ones(4)
    top_k = torch.tensor([1, 5, 17, 40], dtype=torch.int32)
    got = topk_select.select_top_k_candidates(logits, temperature, top_k, 64, use_triton=True)
    want = topk_select.select_top_k_candidates(logits, temperature, top_k, 64, use_triton=False)
    assert topk_select._kernel_failed
    assert torch.equal(got.counts, want.counts)
    for r, n in enumerate(want.counts.tolist()):
        assert torch.equal(got.token_ids[r, :n], want.token_ids[r, :n])


@pytest.fixture(params=["triton", "torch"])
def any_select(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both candidate selects: the kernels (the prefilter and the radix kernel for the rows it flags; interpreted
    on CPU) and the torch version."""
    kwargs = {"use_triton": request.param == "triton"}
    monkeypatch.setattr(fast_path, "select_top_k_candidates", functools.partial(select_top_k_candidates, **kwargs))
    return request.param


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits", "raw_logprobs", "raw_logits"])
def test_bf16_logits_give_the_float32_results(mode: str, any_select: str) -> None:
    """The sampler fed the model's bf16 logits (the fast path reads them as they are) gives bit for bit what it
    gives on their float32 conversion: tokens, logprobs, ranks and masks, with greedy, seeded and unseeded rows,
    min-p, top-p, and rows that take the general path (ties past C, NaN); the generators advance alike."""
    lp = bf16_logits(6, 9)
    lp[1, 50:200] = 12.0  # 150 ties at the top, k=10: past C -> general path
    lp[4, 3] = float("nan")  # -> general path
    low = lp.to(torch.bfloat16)
    torch.testing.assert_close(low.float(), lp, rtol=0, atol=0, equal_nan=True)
    temperature, top_k = [1.0, 0.7, 0.0, 1.3, 1.0, 0.9], [20, 10, 5, 64, 8, 33]
    top_p, min_p = [0.9, 1.0, 0.8, 0.95, 1.0, 0.5], [0.0, 0.0, 0.1, 0.02, 0.0, 0.0]
    outs, states = [], []
    for logits in (low, lp):
        torch.manual_seed(1234)  # the unseeded rows' draws
        gens = {r: torch.Generator(device=DEVICE).manual_seed(40 + r) for r in (0, 3, 4)}
        md = _to_device(make_metadata(6, V, temperature, top_k, top_p, min_p, generators=gens, max_num_logprobs=3,
                                      mask=True))
        outs.append(Sampler(mode)(logits.to(DEVICE), md))
        states.append([g.get_state() for g in gens.values()])
    got, want = outs
    assert all(torch.equal(a, b) for a, b in zip(*states))
    assert got.sampled_token_ids.tolist() == want.sampled_token_ids.tolist()
    assert supports(got) == supports(want)
    assert got.sampling_mask.counts.tolist() == want.sampling_mask.counts.tolist()
    for a, b in zip(got.logprobs_tensors, want.logprobs_tensors):
        assert a.dtype == b.dtype, mode
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=0, atol=0, equal_nan=True)  # bit for bit (NaN row: NaN)
    assert supports(got)[1] == list(range(50, 200))  # the tie row went through the general path
