"""The split radix select (many programs per row) vs a direct sort-based reference and the one-program kernel.

Under TRITON_INTERPRET (no GPU) the kernels run on CPU tensors; small block and segment sizes give several
segments per row, the last one partial, on a vocabulary of a few thousand ids.
"""

from __future__ import annotations

import pytest
import torch

from vllm.v1.sample.ops import topk_select
from vllm.v1.sample.ops.topk_select import TopKCandidates, select_top_k_candidates, split_segment_size

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


def run_split(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
              segment_size: int) -> TopKCandidates:
    return select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), num_cand,
                                   use_triton=True, impl="split", segment_size=segment_size, block_size=BLOCK)


def bf16_logits(num_reqs: int, vocab_size: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_reqs, vocab_size, generator=gen) * 3).to(torch.bfloat16).float()


@pytest.mark.parametrize("vocab_size, segment_size", [(3001, 1024), (2500, 256)])
def test_split_matches_reference_and_row_kernel(vocab_size: int, segment_size: int) -> None:
    logits = bf16_logits(4, vocab_size, vocab_size)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.31])
    top_k = torch.tensor([1, 50, 300, 17], dtype=torch.int32)
    want = reference(logits, temperature, top_k, 400)
    got = run_split(logits, temperature, top_k, 400, segment_size)
    check(got, want)
    row = select_top_k_candidates(logits, temperature, top_k, 400, use_triton=True, impl="row", block_size=BLOCK)
    assert torch.equal(row.counts, got.counts.cpu()) and torch.equal(row.kth, got.kth.cpu())
    for r, n in enumerate(row.counts.tolist()):
        assert torch.equal(row.token_ids[r, :n], got.token_ids[r, :n].cpu())


def test_split_ties_at_the_threshold() -> None:
    vocab_size = 2100
    logits = bf16_logits(4, vocab_size, 1)
    logits[0] = logits[0].round()  # integer logits: big tie groups at every value
    logits[1] = -5.0 - logits[1].abs()
    logits[1, 3:2100:7] = 2.0  # 300 ties spread over every segment, k=10: all 300 kept (C=400)
    logits[2] = -5.0 - logits[2].abs()
    logits[2, 100:1600:3] = 2.0  # 500 ties > C: flagged
    logits[3, :600] = 0.0
    logits[3, 600:1200] = -0.0  # -0.0 ties +0.0
    logits[3, 1200:] = -1.0 - logits[3, 1200:].abs()
    temperature = torch.ones(4)
    top_k = torch.tensor([40, 10, 10, 5], dtype=torch.int32)
    want = reference(logits, temperature, top_k, 400)
    assert [w[0] for w in want][1:] == [300, -1, -1]
    got = run_split(logits, temperature, top_k, 400, 512)
    check(got, want)
    got = run_split(logits, temperature, top_k, 1300, 512)
    check(got, reference(logits, temperature, top_k, 1300))
    assert got.counts.tolist()[2:] == [500, 1200]


def test_split_flags_nan_inf_and_negative_infinity_rows() -> None:
    vocab_size = 1500
    logits = bf16_logits(6, vocab_size, 2)
    logits[0, 1400] = float("nan")  # NaN in the last, partial segment
    logits[1, 7] = float("inf")
    logits[2, :] = float("-inf")
    logits[2, 1000:1003] = 1.0  # fewer than k finite values: the threshold is -inf
    logits[3, :] = float("-inf")
    logits[4, ::2] = float("-inf")  # -inf values below a finite threshold are fine
    logits[5, 3] = float("-nan")
    temperature = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 2.0])
    top_k = torch.full((6,), 10, dtype=torch.int32)
    want = reference(logits, temperature, top_k, 64)
    assert [w[0] for w in want[:4]] == [-1, -1, -1, -1] and want[4][0] >= 10 and want[5][0] == -1
    check(run_split(logits, temperature, top_k, 64, 512), want, check_kth=False)
    row = select_top_k_candidates(logits, temperature, top_k, 64, use_triton=True, impl="row", block_size=BLOCK)
    got = run_split(logits, temperature, top_k, 64, 512)
    assert torch.equal(got.counts.cpu(), row.counts)
    assert torch.equal(got.kth.cpu()[2:5], row.kth[2:5])  # NaN rows: kth is not specified


def test_split_k_bounds() -> None:
    vocab_size = 1300
    logits = bf16_logits(4, vocab_size, 3)
    temperature = torch.tensor([1.0, 0.9, 1.1, 1.0])
    top_k = torch.tensor([vocab_size, vocab_size + 500, 0, 1], dtype=torch.int32)  # k = V, k > V, k < 1
    want = reference(logits, temperature, top_k, vocab_size)
    assert [w[0] for w in want] == [vocab_size, vocab_size, 1, 1]
    check(run_split(logits, temperature, top_k, vocab_size, 256), want)
    # One segment holds the whole row.
    check(run_split(logits, temperature, top_k, vocab_size, 2048), want)


def test_split_falls_back_to_torch_when_it_cannot_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton

    class Broken:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                raise triton.CompilationError("src", None, "cannot compile")
            return launch

    monkeypatch.setattr(topk_select, "_split_hist_kernel", Broken())
    monkeypatch.setattr(topk_select, "_kernel_failed", False)
    logits = bf16_logits(3, 700, 4)
    temperature = torch.ones(3)
    top_k = torch.tensor([1, 5, 40], dtype=torch.int32)
    got = run_split(logits, temperature, top_k, 64, 256)
    assert topk_select._kernel_failed
    check(got, reference(logits, temperature, top_k, 64))


def test_split_argument_validation() -> None:
    logits, temperature, top_k = torch.zeros(1, 100), torch.ones(1), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="impl"):
        select_top_k_candidates(logits, temperature, top_k, 8, impl="columns")
    with pytest.raises(ValueError, match="segment_size"):
        select_top_k_candidates(logits, temperature, top_k, 8, impl="split", segment_size=300, block_size=256)
    with pytest.raises(ValueError, match="block_size"):
        select_top_k_candidates(logits, temperature, top_k, 8, block_size=100)


@pytest.mark.parametrize("num_reqs", [1, 64, 512, 1024])
def test_split_segment_size_fills_the_grid(num_reqs: int) -> None:
    vocab_size, target = 151936, topk_select._TARGET_PROGRAMS
    low, high = topk_select._MIN_SEGMENT_SIZE, topk_select._MAX_SEGMENT_SIZE
    seg = split_segment_size(num_reqs, vocab_size)
    assert low <= seg <= high and seg % topk_select._BLOCK_SIZE == 0 and seg & (seg - 1) == 0
    if seg > low:
        assert num_reqs * -(-vocab_size // seg) >= target
    if seg < high:
        assert num_reqs * -(-vocab_size // (2 * seg)) < target


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("segment_size", [None, 4096, 16384])
def test_split_full_vocabulary_on_gpu(segment_size: int | None) -> None:
    vocab_size, num_reqs = 151936, 48
    logits = bf16_logits(num_reqs, vocab_size, 5)
    logits[0, 5] = float("nan")
    logits[1, 100:100000:97] = 40.0  # 1030 ties spread over the row
    temperature = torch.rand(num_reqs, generator=torch.Generator().manual_seed(6)) + 0.3
    top_k = torch.randint(1, 2048, (num_reqs,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    args = (logits.cuda(), temperature.cuda(), top_k.cuda(), 2600)
    got = select_top_k_candidates(*args, impl="split", segment_size=segment_size)
    row = select_top_k_candidates(*args, impl="row")
    check(got, reference(logits, temperature, top_k, 2600), check_kth=False)
    assert torch.equal(got.counts, row.counts)
    assert torch.equal(got.kth[1:], row.kth[1:])


def test_order_kernel_restores_id_order_from_scrambled_blocks() -> None:
    # NOTE: the interpreter runs the programs of a row in segment order, so the write pass alone never stages
    # blocks out of order there; this stages them in a random block order, as concurrent GPU programs do.
    num_reqs, vocab_size, num_cand, block = 3, 1000, 300, 128
    num_blocks = -(-vocab_size // block)
    gen = torch.Generator().manual_seed(8)
    stage_ids = torch.full((num_reqs, num_cand), -7, dtype=torch.int32)
    block_count = torch.zeros((num_reqs, num_blocks), dtype=torch.int32)
    block_base = torch.full((num_reqs, num_blocks), -1, dtype=torch.int32)
    want = []
    for r in range(num_reqs):
        kept = (torch.rand(vocab_size, generator=gen) < 0.1 * (r + 1)).nonzero().flatten()[:num_cand]
        want.append(kept.tolist())
        slot = 0
        for b in torch.randperm(num_blocks, generator=gen).tolist():
            in_block = kept[(kept // block) == b]
            stage_ids[r, slot:slot + len(in_block)] = in_block.to(torch.int32)
            block_count[r, b], block_base[r, b] = len(in_block), slot
            slot += len(in_block)
    stage_values = stage_ids.float() * 0.5 - 3.0
    block_start = torch.cumsum(block_count, dim=1, dtype=torch.int32) - block_count
    counts = torch.tensor([len(w) for w in want], dtype=torch.int32)
    ids = torch.full((num_reqs, num_cand), -1, dtype=torch.int32)
    values = torch.zeros((num_reqs, num_cand))
    tensors = [t.to(DEVICE) for t in (stage_ids, stage_values, block_start, block_base, ids, values, counts)]
    s_ids, s_values, start, base, out_ids, out_values, out_counts = tensors
    topk_select._split_order_kernel[(num_reqs,)](s_ids, s_values, start, base, num_blocks, out_ids, out_values,
                                                 num_cand, out_counts, BLOCK_SIZE=block, ORDER_BLOCK_SIZE=64)
    for r, kept in enumerate(want):
        assert len(kept) > 0 and out_ids[r, :len(kept)].tolist() == kept
        assert out_values[r, :len(kept)].tolist() == [k * 0.5 - 3.0 for k in kept]


def run_topk(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int) -> TopKCandidates:
    return select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), num_cand,
                                   use_triton=True, impl="topk")


def test_topk_impl_matches_reference() -> None:
    """impl="topk" (torch.topk threshold + one counting read) against the sort reference: random rows at several
    temperatures, tie groups inside and past C, +-0.0 ties, NaN/+inf/-inf rows and the k bounds."""
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
