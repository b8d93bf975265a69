"""The top-k candidate selects ("topk": torch.topk + a counting read; "row": the radix kernel) vs a direct
sort-based reference. Under TRITON_INTERPRET (no GPU) the kernels run on CPU tensors on a few thousand ids."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.sample.ops import topk_select
from vllm.v1.sample.ops.topk_select import TopKCandidates, select_top_k_candidates

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 256


def reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              num_cand: int) -> list[tuple[int, float, list[int], list[float]]]:
    """Per row (count or -1, kth, ids, values) from a full descending sort of z = logits / temperature."""
    rows = []
    vocab_size = logits.shape[1]
    for r in range(logits.shape[0]):
        z = logits[r].float() / temperature[r].float()  # [V] float32, the same IEEE division as the kernels
        k = min(max(int(top_k[r]), 1), vocab_size)
        bad = bool(torch.isnan(z).any() or (z == float("inf")).any())
        finite_or_ninf = torch.where(torch.isnan(z), float("-inf"), z)
        kth = float(finite_or_ninf.sort(descending=True).values[k - 1])
        kept = (z >= kth).nonzero().flatten()
        ok = not bad and len(kept) <= num_cand and kth > float("-inf")
        count = len(kept) if ok else -1
        rows.append((count, kth, kept.tolist(), z[kept].tolist()))
    return rows


def check(cand: TopKCandidates, want: list[tuple[int, float, list[int], list[float]]], check_kth: bool = True) -> None:
    assert cand.counts.tolist() == [w[0] for w in want]
    for r, (count, kth, ids, values) in enumerate(want):
        if check_kth:
            assert float(cand.kth[r]) == kth, r
        if count >= 0:
            assert cand.token_ids[r, :count].tolist() == ids, r
            assert torch.equal(cand.values[r, :count].cpu(), torch.tensor(values, dtype=torch.float32)), r


def bf16_logits(num_reqs: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_reqs, vocab_size, generator=gen) * 3).to(torch.bfloat16).float()


def run_topk(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int) -> TopKCandidates:
    return select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), num_cand,
                                   use_triton=True, impl="topk")


def test_topk_impl_matches_reference() -> None:
    """impl="topk" (torch.topk threshold + one counting read) against the sort reference: random rows at several
    temperatures, tie groups inside and past C, +-0.0 ties, NaN/+inf/-inf rows and the k bounds (also k > C)."""
    logits = bf16_logits(4, 3001, 3001)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.31])
    top_k = torch.tensor([1, 50, 300, 17], dtype=torch.int32)
    check(run_topk(logits, temperature, top_k, 400), reference(logits, temperature, top_k, 400))

    ties = bf16_logits(4, 2100, 1)
    ties[0] = ties[0].round()
    ties[1] = -5.0 - ties[1].abs()
    ties[1, 3:2100:7] = 2.0
    ties[2] = -5.0 - ties[2].abs()
    ties[2, 100:1600:3] = 2.0
    ties[3, :600] = 0.0
    ties[3, 600:1200] = -0.0
    ties[3, 1200:] = -1.0 - ties[3, 1200:].abs()
    ones = torch.ones(4)
    tie_k = torch.tensor([40, 10, 10, 5], dtype=torch.int32)
    for num_cand in (400, 1300):
        want = reference(ties, ones, tie_k, num_cand)
        check(run_topk(ties, ones, tie_k, num_cand), want)
    assert [w[0] for w in reference(ties, ones, tie_k, 400)][1:] == [300, -1, -1]

    bad = bf16_logits(6, 1500, 2)
    bad[0, 1400] = float("nan")
    bad[1, 7] = float("inf")
    bad[2, :] = float("-inf")
    bad[2, 1000:1003] = 1.0
    bad[3, :] = float("-inf")
    bad[4, ::2] = float("-inf")
    bad[5, 3] = float("-nan")
    bad_t = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 2.0])
    bad_k = torch.full((6,), 10, dtype=torch.int32)
    want = reference(bad, bad_t, bad_k, 64)
    assert [w[0] for w in want] [:4] == [-1, -1, -1, -1] and want[4][0] >= 10
    check(run_topk(bad, bad_t, bad_k, 64), want, check_kth=False)

    small = bf16_logits(4, 1300, 3)
    small_t = torch.tensor([1.0, 0.9, 1.1, 1.0])
    small_k = torch.tensor([1300, 1800, 0, 1], dtype=torch.int32)
    check(run_topk(small, small_t, small_k, 1300), reference(small, small_t, small_k, 1300))

    # float32 logits that are not bf16 values, k up to and past C (k > C: more than C values >= kth, so -1; the
    # threshold of such a row is not checked, no caller reads it).
    dense = torch.randn(4, 4000, generator=torch.Generator().manual_seed(8)) * 0.001 + 2.0
    dense_t = torch.tensor([1.0, 0.37, 1.9, 1.0])
    for dense_k in ([7, 100, 250, 1], [300, 299, 1, 301]):
        k_t = torch.tensor(dense_k, dtype=torch.int32)
        want = reference(dense, dense_t, k_t, 300)
        check(run_topk(dense, dense_t, k_t, 300), want, check_kth=False)
        assert all(float(got) == w[1] for got, w in zip(run_topk(dense, dense_t, k_t, 300).kth, want) if w[0] >= 0)
    # The data do what the case is for: the reference marks the k > C row (and only it) -1.
    assert [w[0] for w in reference(dense, dense_t, torch.tensor([300, 299, 1, 301], dtype=torch.int32), 300)] \
        == [300, 299, 1, -1]


def test_select_argument_validation() -> None:
    logits, temperature, top_k = torch.zeros(1, 100), torch.ones(1), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="impl"):
        select_top_k_candidates(logits, temperature, top_k, 8, impl="columns")
    with pytest.raises(ValueError, match="block_size"):
        select_top_k_candidates(logits, temperature, top_k, 8, block_size=100)


def test_topk_impl_falls_back_to_torch_when_it_cannot_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    class Broken:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise triton.CompilationError("src", None, "cannot compile")
            return launch

    monkeypatch.setattr(topk_select, "_count_at_least_kernel", Broken())
    monkeypatch.setattr(topk_select, "_kernel_failed", False)
    logits = bf16_logits(3, 700, 4)
    temperature = torch.ones(3)
    top_k = torch.tensor([1, 5, 40], dtype=torch.int32)
    got = run_topk(logits, temperature, top_k, 64)
    assert topk_select._kernel_failed
    check(got, reference(logits, temperature, top_k, 64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_topk_impl_full_vocabulary_on_gpu() -> None:
    vocab_size, num_reqs = 151936, 48
    logits = bf16_logits(num_reqs, vocab_size, 5)
    logits[0, 5] = float("nan")
    logits[1, 100:100000:97] = 40.0  # 1030 ties spread over the row
    temperature = torch.rand(num_reqs, generator=torch.Generator().manual_seed(6)) + 0.3
    top_k = torch.randint(1, 2048, (num_reqs,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    args = (logits.cuda(), temperature.cuda(), top_k.cuda(), 2600)
    got = select_top_k_candidates(*args, impl="topk")
    row = select_top_k_candidates(*args, impl="row")
    check(got, reference(logits, temperature, top_k, 2600), check_kth=False)
    assert torch.equal(got.counts, row.counts)
    assert torch.equal(got.kth[1:], row.kth[1:])


def test_row_kernel_selects_only_flagged_rows() -> None:
    """With a row flag the radix kernel writes the flagged rows as it does without one and leaves the others."""
    logits = bf16_logits(4, 900, 12)
    temperature = torch.tensor([1.0, 0.6, 1.0, 2.0])
    top_k = torch.tensor([5, 30, 1, 64], dtype=torch.int32)
    ids = torch.full((4, 64), -7, dtype=torch.int32)
    values = torch.full((4, 64), -7.0)
    counts = torch.full((4,), -7, dtype=torch.int32)
    kth = torch.full((4,), -7.0)
    flag = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    topk_select._run_row_kernel(logits, temperature, top_k, ids, values, counts, kth, BLOCK, row_flag=flag)
    want = reference(logits, temperature, top_k, 64)
    check(TopKCandidates(ids[::2], values[::2], counts[::2], kth[::2]), want[::2])
    assert counts[1::2].tolist() == [-7, -7] and kth[1::2].tolist() == [-7.0, -7.0]
    assert (ids[1::2] == -7).all() and (values[1::2] == -7.0).all()
