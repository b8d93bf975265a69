"""The top-k candidate selects ("topk": torch.topk + a counting read; "row": the radix kernel; "prefilter":
chunk maxima, a gathered buffer and the radix kernel for overflow rows) vs a direct sort-based reference. Under
TRITON_INTERPRET (no GPU) the kernels run on CPU tensors on a few thousand ids."""

from __future__ import annotations

import pytest
import torch

from vllm.v1.sample.ops import topk_prefilter, topk_select
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


def tie_rows() -> torch.Tensor:
    """[4, 2100]: rounded values (ties everywhere), 300 ties at the top, 500 ties at the top, and 600 +0.0 with
    600 -0.0 above a negative rest; with top_k (40, 10, 10, 5) and C = 400, row 1's 300 ties fit, rows 2 and 3
    tie past C."""
    ties = bf16_logits(4, 2100, 1)
    ties[0] = ties[0].round()
    ties[1] = -5.0 - ties[1].abs()
    ties[1, 3:2100:7] = 2.0
    ties[2] = -5.0 - ties[2].abs()
    ties[2, 100:1600:3] = 2.0
    ties[3, :600] = 0.0
    ties[3, 600:1200] = -0.0
    ties[3, 1200:] = -1.0 - ties[3, 1200:].abs()
    return ties


def run_topk(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int) -> TopKCandidates:
    return select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), num_cand,
                                   use_triton=True)


def test_select_matches_reference() -> None:
    """The select's kernels (the prefilter, with the radix kernel for the rows it flags) against the sort
    reference: random rows at several temperatures, tie groups inside and past C, +-0.0 ties, NaN/+inf/-inf rows
    and the k bounds (also k > C)."""
    logits = bf16_logits(4, 3001, 3001)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.31])
    top_k = torch.tensor([1, 50, 300, 17], dtype=torch.int32)
    check(run_topk(logits, temperature, top_k, 400), reference(logits, temperature, top_k, 400))

    ties = tie_rows()
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
    with pytest.raises(ValueError, match="block_size"):
        select_top_k_candidates(logits, temperature, top_k, 8, block_size=100)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_select_full_vocabulary_on_gpu_matches_the_radix_kernel() -> None:
    vocab_size, num_reqs = 151936, 48
    logits = bf16_logits(num_reqs, vocab_size, 5)
    logits[0, 5] = float("nan")
    logits[1, 100:100000:97] = 40.0  # 1030 ties spread over the row
    temperature = torch.rand(num_reqs, generator=torch.Generator().manual_seed(6)) + 0.3
    top_k = torch.randint(1, 2048, (num_reqs,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    args = (logits.cuda(), temperature.cuda(), top_k.cuda(), 2600)
    got = select_top_k_candidates(*args)
    row = TopKCandidates(torch.empty(num_reqs, 2600, dtype=torch.int32, device="cuda"),
                         torch.empty(num_reqs, 2600, device="cuda"),
                         torch.empty(num_reqs, dtype=torch.int32, device="cuda"), torch.empty(num_reqs, device="cuda"))
    topk_select._run_row_kernel(*args[:3], *row, 1024)  # the radix kernel on every row
    check(got, reference(logits, temperature, top_k, 2600), check_kth=False)
    assert torch.equal(got.counts, row.counts)
    assert torch.equal(got.kth[1:], row.kth[1:])


# The prefilter: chunk maxima bound the threshold from below, the values above the bound are gathered into a
# per-row buffer of `cap` slots, the rows whose buffer overflows take the radix kernel. Small chunks and caps
# so that every path runs on a few thousand ids.


def run_prefilter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
                  chunk: int = 32, cap: int | None = None, block: int = BLOCK) -> TopKCandidates:
    return select_top_k_candidates(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), num_cand,
                                   use_triton=True, block_size=block, prefilter_chunk=chunk,
                                   prefilter_cap=cap)


def overflow_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int, chunk: int,
                  cap: int) -> list[int]:
    """The rows the buffer cannot hold, from the bound written out: t0 = the k-th largest maximum of `chunk`
    consecutive z (-inf when there are fewer than k chunks); a row overflows when more than cap z are >= t0 and
    > -inf, unless it is -1 anyway (a NaN or +inf, or k > C)."""
    rows = []
    vocab_size = logits.shape[1]
    for r in range(logits.shape[0]):
        z = logits[r].float() / temperature[r].float()  # [V]
        k = min(max(int(top_k[r]), 1), vocab_size)
        if torch.isnan(z).any() or (z == float("inf")).any() or k > num_cand:
            continue
        padded = torch.full((-(-vocab_size // chunk) * chunk,), float("-inf"))
        padded[:vocab_size] = z
        maxima = padded.view(-1, chunk).amax(dim=-1).sort(descending=True).values  # [NCH]
        t0 = float(maxima[k - 1]) if k <= len(maxima) else float("-inf")
        if int(((z >= t0) & (z > float("-inf"))).sum()) > cap:
            rows.append(r)
    return rows


def check_prefilter(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
                    chunk: int = 32, cap: int | None = None, block: int = BLOCK) -> list[int]:
    """The prefilter against the sort reference and the torch select: the same counts (-1 on the same rows),
    and on every other row the same ids, values and kth. Returns the counts."""
    got = run_prefilter(logits, temperature, top_k, num_cand, chunk, cap, block)
    want = reference(logits, temperature, top_k, num_cand)
    check(got, want, check_kth=False)
    held = [r for r, w in enumerate(want) if w[0] >= 0]
    assert [float(got.kth[r]) for r in held] == [want[r][1] for r in held]
    torch_select = select_top_k_candidates(logits, temperature, top_k, num_cand, use_triton=False)
    assert torch.equal(got.counts.cpu(), torch_select.counts)
    for r in held:
        n = int(got.counts[r])
        assert torch.equal(got.token_ids[r, :n].cpu(), torch_select.token_ids[r, :n])
        assert torch.equal(got.values[r, :n].cpu(), torch_select.values[r, :n])
    return [w[0] for w in want]


@pytest.fixture
def row_kernel_flags(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The rows each prefilter call hands to the radix kernel."""
    calls: list[list[int]] = []
    run = topk_select._run_row_kernel

    def spy(*args, row_flag: torch.Tensor | None = None, **kwargs) -> None:  # noqa: ANN002, ANN003
        calls.append(row_flag.nonzero().flatten().tolist() if row_flag is not None else None)
        run(*args, row_flag=row_flag, **kwargs)

    monkeypatch.setattr(topk_select, "_run_row_kernel", spy)
    return calls


def consecutive_floats(num_reqs: int, vocab_size: int, start: float, seed: int) -> torch.Tensor:
    """Rows of distinct, adjacent float32 values in a random order."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.tensor([start], dtype=torch.float32).view(torch.int32)
    steps = torch.stack([torch.randperm(vocab_size, generator=gen) for _ in range(num_reqs)]).to(torch.int32)
    return (base + steps).view(torch.float32)


def test_prefilter_matches_reference(row_kernel_flags: list[list[int]]) -> None:
    """Rows the buffer holds (the radix kernel runs on none of them): random bf16-valued rows as float32 and as a
    bf16 tensor, float32 rows of adjacent values whose division merges neighbours into equal z (a tie at the
    threshold), ties inside and past C, +-0.0, NaN/+inf/-inf rows and the k bounds (k > NCH through t0 = -inf)."""
    logits = bf16_logits(4, 3001, 3001)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.31])
    top_k = torch.tensor([1, 50, 90, 17], dtype=torch.int32)
    check_prefilter(logits, temperature, top_k, 400)
    check_prefilter(logits.to(torch.bfloat16), temperature, top_k, 400)

    adjacent = consecutive_floats(3, 3001, 1.9, 11)
    merge_t = torch.tensor([1.5, 1.5, 3.0])
    merge_k = torch.tensor([10, 101, 150], dtype=torch.int32)
    assert all(len(set((adjacent[r] / merge_t[r]).tolist())) < 3001 for r in range(3))
    assert check_prefilter(adjacent, merge_t, merge_k, 400, chunk=16) == [10, 102, 150]

    ties = tie_rows()
    tie_k = torch.tensor([40, 10, 10, 5], dtype=torch.int32)
    assert check_prefilter(ties, torch.ones(4), tie_k, 400)[1:] == [300, -1, -1]
    check_prefilter(ties, torch.ones(4), tie_k, 1300)

    bad = bf16_logits(6, 1500, 2)
    bad[0, 1400] = float("nan")
    bad[1, 7] = float("inf")
    bad[2, :] = float("-inf")
    bad[2, 1000:1003] = 1.0
    bad[3, :] = float("-inf")
    bad[4, ::2] = float("-inf")
    bad[5, 3] = float("-nan")
    bad_t = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.5, 2.0])
    counts = check_prefilter(bad, bad_t, torch.full((6,), 10, dtype=torch.int32), 64)
    assert counts[:4] == [-1, -1, -1, -1] and counts[4] >= 10 and counts[5] == -1

    small = bf16_logits(4, 1300, 3)
    small_k = torch.tensor([1300, 1800, 0, 100], dtype=torch.int32)
    assert 100 > 1300 // 32
    check_prefilter(small, torch.tensor([1.0, 0.9, 1.1, 1.0]), small_k, 1300)
    assert row_kernel_flags and all(flags == [] for flags in row_kernel_flags)


def test_prefilter_overflow_rows_with_short_lists_skip_the_radix_kernel(row_kernel_flags: list[list[int]]) -> None:
    """Rows with more than cap values at or above the bound: the large values packed into a few consecutive
    chunks (so the k-th chunk maximum lies far below kth), fewer chunks than k, a tie group past C, and cap + 1
    values > -inf with k > NCH (while cap of them fit). Their chunk lists are short (NCH = 32 <= 2C), so the row
    program selects them from their listed chunks: the reference's outputs, and none goes to the radix kernel."""
    logits = bf16_logits(8, 1000, 9)
    logits[0, 300:700] = 20.0 + torch.randn(400, generator=torch.Generator().manual_seed(1))
    logits[1, :] = logits[1].round()
    logits[2, 40:340] = 30.0
    logits[3, 960:] = 15.0 + torch.arange(40.0)
    logits[5, 100:300:2] = float("-inf")
    logits[6, 128:] = float("-inf")
    logits[7, 129:] = float("-inf")
    temperature = torch.tensor([1.0, 0.8, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0])
    top_k = torch.tensor([30, 40, 10, 20, 3, 50, 40, 40], dtype=torch.int32)
    assert overflow_rows(logits, temperature, top_k, 64, 32, 128) == [0, 1, 2, 5, 7]
    counts = check_prefilter(logits, temperature, top_k, 64, cap=128)
    assert counts[0] >= 30 and counts[2] == -1 and counts[3] >= 20 and min(counts[6:]) >= 40
    assert row_kernel_flags == [[]]


def test_row_kernel_selects_only_flagged_rows() -> None:
    """With a row flag the radix kernel writes the flagged rows as it does without one and leaves the others."""
    logits = bf16_logits(4, 900, 12)
    temperature = torch.tensor([1.0, 0.6, 1.0, 2.0])
    top_k = torch.tensor([5, 30, 1, 64], dtype=torch.int32)
    want = reference(logits, temperature, top_k, 64)
    ids = torch.full((4, 64), -7, dtype=torch.int32, device=DEVICE)
    values = torch.full((4, 64), -7.0, device=DEVICE)
    counts = torch.full((4,), -7, dtype=torch.int32, device=DEVICE)
    kth = torch.full((4,), -7.0, device=DEVICE)
    flag = torch.tensor([1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    topk_select._run_row_kernel(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), ids, values, counts,
                                kth, BLOCK, row_flag=flag)
    check(TopKCandidates(ids[::2], values[::2], counts[::2], kth[::2]), want[::2])
    assert counts[1::2].tolist() == [-7, -7] and kth[1::2].tolist() == [-7.0, -7.0]
    assert (ids[1::2] == -7).all() and (values[1::2] == -7.0).all()


def test_prefilter_mixed_batch(row_kernel_flags: list[list[int]]) -> None:
    """Every kind of row in one batch, float32 and bf16: held rows (random, a tie merged by the division, k > NCH
    with few finite values), -1 rows (ties past C, NaN, +inf, all -inf, fewer finite values than k, k > C) and
    overflow rows (a cluster, k > NCH; selected from their listed chunks), at chunk 16 and cap 256."""
    vocab_size, num_cand, chunk, cap = 2000, 128, 16, 256
    logits = bf16_logits(11, vocab_size, 21)
    logits[1] = consecutive_floats(1, vocab_size, 1.9, 3)[0]
    logits[2, 1000:1200] = 25.0
    logits[3, 17] = float("nan")
    logits[4, 1999] = float("inf")
    logits[5, :] = float("-inf")
    logits[6, 200:] = float("-inf")
    logits[7, 100:] = float("-inf")
    logits[8, 1500:1900] = 18.0 + torch.randn(400, generator=torch.Generator().manual_seed(2))
    logits[10, 1850:] = float("-inf")
    temperature = torch.tensor([0.9, 1.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.7])
    top_k = torch.tensor([7, 99, 20, 5, 5, 5, 127, 120, 30, 200, 126], dtype=torch.int32)
    assert vocab_size // chunk < 126 < 127 <= num_cand
    assert overflow_rows(logits, temperature, top_k, num_cand, chunk, cap) == [8, 10]
    want = [7, 100, -1, -1, -1, -1, 127, -1, 30, -1, 127]
    assert check_prefilter(logits, temperature, top_k, num_cand, chunk, cap) == want
    bf16 = logits.to(torch.bfloat16)
    bf16[1] = bf16_logits(1, vocab_size, 4)[0].to(torch.bfloat16)
    assert overflow_rows(bf16, temperature, top_k, num_cand, chunk, cap) == [8, 10]
    assert [c >= 0 for c in check_prefilter(bf16, temperature, top_k, num_cand, chunk, cap)] == [c >= 0 for c in want]
    assert row_kernel_flags == [[], []]


def expected_gather(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
                    chunk: int) -> list[tuple[float, int, list[int]]]:
    """Per row (t0, the number of chunks with a maximum >= t0 and > -inf, the ascending ids of z >= t0 and > -inf),
    written out: t0 = the k-th largest maximum of `chunk` consecutive z (a NaN counted as +inf), -inf when there
    are fewer than k chunks, +inf when k > C."""
    rows = []
    vocab_size = logits.shape[1]
    for r in range(logits.shape[0]):
        z = logits[r].float() / temperature[r].float()  # [V]
        k = min(max(int(top_k[r]), 1), vocab_size)
        padded = torch.full((-(-vocab_size // chunk) * chunk,), float("-inf"))
        padded[:vocab_size] = torch.where(torch.isnan(z), float("inf"), z)
        maxima = padded.view(-1, chunk).amax(dim=-1)  # [NCH]
        ordered = maxima.sort(descending=True).values  # [NCH]
        t0 = float("inf") if k > num_cand else float(ordered[k - 1]) if k <= len(ordered) else float("-inf")
        num_listed = int(((maxima >= t0) & (maxima > float("-inf"))).sum())
        rows.append((t0, num_listed, ((z >= t0) & (z > float("-inf"))).nonzero().flatten().tolist()))
    return rows


def run_prefilter_scratch(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
                          chunk: int, cap: int, block: int) -> tuple[TopKCandidates, topk_prefilter.PrefilterScratch]:
    num_reqs = logits.shape[0]
    out = TopKCandidates(torch.empty((num_reqs, num_cand), dtype=torch.int32, device=DEVICE),
                         torch.empty((num_reqs, num_cand), dtype=torch.float32, device=DEVICE),
                         torch.empty((num_reqs,), dtype=torch.int32, device=DEVICE),
                         torch.empty((num_reqs,), dtype=torch.float32, device=DEVICE))
    scratch = topk_select._select_prefilter(logits.to(DEVICE), temperature.to(DEVICE), top_k.to(DEVICE), *out,
                                            block, chunk, cap)
    return out, scratch


def gather_case_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V = 1001 (a last chunk of one id at S = 8): random at T = 0.7, all negative, rounded ties with the largest
    value in the last chunk (the next row starts with larger ones), k > NCH with -inf past id 300, k > C, a NaN in
    the last chunk (and two large values in the first, so that only the NaN check can make the row -1), +-0.0 over
    800 ids, a cluster, k = NCH, three finite ids."""
    logits = bf16_logits(10, 1001, 31)
    logits[1] = -5.0 - logits[1].abs()
    logits[2] = logits[2].round()
    logits[2, 1000] = 50.0
    logits[3, :7] = 60.0
    logits[3, 300:] = float("-inf")
    logits[5, :2] = torch.tensor([30.0, 31.0])
    logits[5, 1000] = float("nan")
    logits[6, :500] = 0.0
    logits[6, 500:800] = -0.0
    logits[6, 800:] = -1.0 - logits[6, 800:].abs()
    logits[7, 100:600] = 20.0 + logits[7, 100:600]
    logits[9, :] = float("-inf")
    logits[9, [5, 6, 700]] = torch.tensor([1.0, 2.0, 3.0])
    temperature = torch.tensor([0.7, 1.0, 1.0, 1.3, 1.0, 1.0, 1.0, 0.9, 1.0, 1.0])
    top_k = torch.tensor([20, 9, 30, 130, 250, 10, 5, 30, 126, 10], dtype=torch.int32)
    return logits, temperature, top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefilter_bound_and_gather_are_exact(dtype: torch.dtype) -> None:
    """The per-row kernel's bound is the k-th largest chunk maximum bit for bit, it lists exactly the chunks with a
    maximum >= t0 and > -inf, its buffer holds exactly the z >= t0 (> -inf) in ascending id order (where it
    overflows, num_above is past cap, the row is selected from its listed chunks and the buffer holds its z >= kth,
    the first cap of them), no row goes to the radix kernel (NCH = 126 <= 2C), and kth is the reference's on every row that is not bad and has k <= C (-inf with fewer than k values > -inf); with
    a 32-id block every loop (the bound's 32 counting steps over 126 maxima, the chunk list, the gather, the select
    over the buffer) runs over several blocks."""
    logits, temperature, top_k = gather_case_rows()
    logits = logits.to(dtype)
    num_cand, chunk, cap = 200, 8, 500
    got, scratch = run_prefilter_scratch(logits, temperature, top_k, num_cand, chunk, cap, block=32)
    gathered = expected_gather(logits, temperature, top_k, num_cand, chunk)
    want = reference(logits, temperature, top_k, num_cand)
    check(got, want, check_kth=False)
    overflow = [r for r, (_, _, ids) in enumerate(gathered) if len(ids) > cap]
    assert overflow == [6, 8] and len(gathered[3][2]) == 300 and len(gathered[9][2]) == 3 and gathered[4][2] == []
    assert gathered[4][0] == float("inf") and gathered[9][0] == float("-inf") and gathered[1][0] < 0
    assert 1000 not in gathered[5][2] and len(gathered[5][2]) >= 10 and want[5][0] == -1 and want[9][0] == -1
    assert gathered[2][2][-1] == 1000
    assert gathered[3][1] == 38 and gathered[9][1] == 2
    assert scratch.refined.tolist() == [int(r in overflow) for r in range(10)] and scratch.row_flag.sum() == 0
    for r, (t0, num_listed, ids) in enumerate(gathered):
        assert float(scratch.t0[r]) == t0 and int(scratch.num_listed[r]) == num_listed, r
        assert int(scratch.num_above[r]) == len(ids) if len(ids) <= cap else int(scratch.num_above[r]) > cap, r
        if r in overflow:
            z = logits[r].float() / temperature[r]
            ids = (z >= want[r][1]).nonzero().flatten().tolist()
        n = min(len(ids), cap)
        assert scratch.buf_ids[r, :n].tolist() == ids[:n], r
        z = logits[r].float() / temperature[r]
        assert torch.equal(scratch.buf_values[r, :n].cpu(), z[ids[:n]]), r
        if r not in (4, 5):
            assert float(got.kth[r]) == want[r][1], r


def test_prefilter_small_blocks_match_reference(row_kernel_flags: list[list[int]]) -> None:
    """16-id blocks, C = cap = 128, S = 4 (NCH = 64): k > NCH with 256 values > -inf (the buffer fills exactly at
    a block boundary with more to come: overflow) and with 128 (it fills exactly: held), -inf before id 128, a
    buffer whose first blocks hold no value >= kth (the large values sit in the last ids), and plain rows."""
    vocab_size, num_cand, chunk = 256, 128, 4
    logits = bf16_logits(6, vocab_size, 41)
    logits[1, 128:] = float("-inf")
    logits[3, :128] = float("-inf")
    logits[4, 200:] = 10.0 + torch.arange(56.0)
    temperature = torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 0.6])
    top_k = torch.tensor([100, 70, 10, 100, 20, 1], dtype=torch.int32)
    gathered = expected_gather(logits, temperature, top_k, num_cand, chunk)
    assert [len(ids) for _, _, ids in gathered[:4]] == [256, 128, len(gathered[2][2]), 128]
    first_kept = gathered[4][2].index(236)
    assert first_kept >= 16 and all(i >= 200 for i in gathered[4][2][first_kept - 16:])
    counts = check_prefilter(logits, temperature, top_k, num_cand, chunk, num_cand, block=16)
    assert min(counts) >= 1
    counts = check_prefilter(logits.to(torch.bfloat16), temperature, top_k, num_cand, chunk, num_cand, block=16)
    assert min(counts) >= 1
    assert row_kernel_flags == [[], []]


def test_prefilter_argument_validation() -> None:
    logits, temperature, top_k = torch.zeros(1, 100), torch.ones(1), torch.ones(1, dtype=torch.int32)
    for chunk in (1, 24, 512):
        with pytest.raises(ValueError, match="prefilter_chunk"):
            select_top_k_candidates(logits, temperature, top_k, 8, block_size=256,
                                    prefilter_chunk=chunk)
    with pytest.raises(ValueError, match="prefilter_cap"):
        select_top_k_candidates(logits, temperature, top_k, 8, prefilter_cap=7)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefilter_full_vocabulary_on_gpu(dtype: torch.dtype, row_kernel_flags: list[list[int]]) -> None:
    """The compiled kernels at the real shape: random rows, a NaN, a tie group past C, k > C, one row whose top
    values fill 8192 consecutive ids (its buffer overflows; selected from its listed chunks) and a row with all but
    300 ids at -inf; then at C = 640 a cluster row (listed chunks) and a cluster row whose other chunks all have
    the maximum 20.0 (4620 chunks listed > 2C: the radix kernel)."""
    vocab_size, num_reqs, num_cand = 151936, 48, 2600
    logits = bf16_logits(num_reqs, vocab_size, 5)
    logits[0, 5] = float("nan")
    logits[1, 100:100000:97] = 40.0
    logits[2, 50000:58192] = 30.0 + logits[2, 50000:58192]
    logits[3, 300:] = float("-inf")
    temperature = torch.rand(num_reqs, generator=torch.Generator().manual_seed(6)) + 0.3
    top_k = torch.randint(1, 2048, (num_reqs,), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    top_k[2:4] = torch.tensor([1000, 200], dtype=torch.int32)
    top_k[4] = 3000
    logits = logits.to(dtype)
    assert overflow_rows(logits, temperature, top_k, num_cand, 32, 2 * num_cand) == [2]
    got = select_top_k_candidates(logits.cuda(), temperature.cuda(), top_k.cuda(), num_cand)
    want = reference(logits, temperature, top_k, num_cand)
    check(got, want, check_kth=False)
    assert all(float(got.kth[r]) == w[1] for r, w in enumerate(want) if w[0] >= 0)
    counts = [w[0] for w in want]
    assert counts[0] == counts[4] == -1 and min(counts[1:4]) >= 200 and row_kernel_flags == [[]]
    clustered = logits[5:8].clone()
    clustered[:2, :4096] = 40.0 + clustered[:2, :4096]
    clustered[1, 4096::32] = 20.0
    top_k = torch.tensor([512, 512, 300], dtype=torch.int32)
    temperature = torch.tensor([1.0, 0.7, 1.0])
    assert overflow_rows(clustered, temperature, top_k, 640, 32, 2048) == [0, 1]
    got = select_top_k_candidates(clustered.cuda(), temperature.cuda(), top_k.cuda(), 640)
    want = reference(clustered, temperature, top_k, 640)
    check(got, want)
    assert min(w[0] for w in want) >= 300 and row_kernel_flags == [[], [1]]


def expected_paths(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int, chunk: int,
                   cap: int) -> tuple[list[int], list[int]]:
    """(the overflow rows selected from their listed chunks, those left to the radix kernel), written out: an
    overflow row (`overflow_rows`) goes to the radix kernel when more than 2C chunks are listed."""
    gathered = expected_gather(logits, temperature, top_k, num_cand, chunk)
    overflow = overflow_rows(logits, temperature, top_k, num_cand, chunk, cap)
    return ([r for r in overflow if gathered[r][1] <= 2 * num_cand],
            [r for r in overflow if gathered[r][1] > 2 * num_cand])


def listed_case_rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """V = 2047 (a last chunk of 3 ids at S = 4, NCH = 512), C = 64, cap = 128: clusters of 200 large values (50
    chunks, fewer than k: t0 falls below them and the buffer overflows; distinct bf16 values) at the start, at the end (through the last
    partial chunk) and in the middle (from id 901, inside a chunk); a cluster of adjacent float32 values that the
    division merges; 100 ties at kth (C < count <= cap) and 200 (count > cap) before a cluster; a cluster with one
    15.0 in every other chunk (t0 = 15.0, 512 chunks listed > 2C: the radix kernel) and a rounded row of ties with
    over 128 chunks at its maximum (the radix kernel, -1); a plain row, a NaN row and a k > C row with clusters."""
    vocab_size = 2047
    logits = bf16_logits(11, vocab_size, 51)
    gen = torch.Generator().manual_seed(52)
    # NOTE: distinct bf16 values from 16.0 up (200 consecutive ones), so the clusters have no ties in either dtype.
    base = torch.tensor([16.0], dtype=torch.bfloat16).view(torch.int16)
    noise = torch.stack([(base + torch.randperm(200, generator=gen).to(torch.int16)).view(torch.bfloat16).float()
                         for _ in range(11)]) - 30.0  # [11, 200]
    logits[0, :200] = 30.0 + noise[0]
    logits[1, vocab_size - 200:] = 30.0 + noise[1]
    logits[2, 901:1101] = 30.0 + noise[2]
    logits[3, 500:700] = consecutive_floats(1, 200, 30.0, 53)[0]
    logits[4, 300:400] = 30.0
    logits[4, 400:500] = noise[4, :100]
    logits[5, 300:500] = 30.0
    logits[6, :200] = 30.0 + noise[6]
    logits[6, 200::4] = 15.0
    logits[7] = logits[7].round().clamp(max=4.0)
    logits[9, :200] = 30.0 + noise[9]
    logits[9, 1500] = float("nan")
    logits[10, :200] = 30.0 + noise[10]
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.5, 1.0, 1.0, 0.9, 1.0, 0.8, 1.0, 1.0])
    top_k = torch.tensor([60, 55, 64, 57, 60, 60, 60, 10, 30, 60, 65], dtype=torch.int32)
    return logits, temperature, top_k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefilter_overflow_rows_selected_from_listed_chunks(dtype: torch.dtype,
                                                              row_kernel_flags: list[list[int]]) -> None:
    """Overflow rows whose chunk list is short (<= 2C chunks) are selected in the row program from their listed
    chunks, those with a longer list by the radix kernel, and every row equals the reference; 64-id blocks make the
    bisection and the second gather run over several blocks."""
    logits, temperature, top_k = listed_case_rows()
    logits = logits.to(dtype)
    num_cand, chunk, cap = 64, 4, 128
    refined, radix = expected_paths(logits, temperature, top_k, num_cand, chunk, cap)
    assert (refined, radix) == ([0, 1, 2, 3, 4, 5], [6, 7])
    counts = check_prefilter(logits, temperature, top_k, num_cand, chunk, cap, block=64)
    assert counts[:4] == [60, 55, 64, counts[3]] and counts[4:8] == [-1, -1, 60, -1] and counts[9:] == [-1, -1]
    want = reference(logits, temperature, top_k, num_cand)
    assert [int((logits[r].float() >= want[r][1]).sum()) for r in (4, 5)] == [100, 200]
    if dtype == torch.float32:
        z = logits[3, 500:700] / temperature[3]
        assert len(set(z.tolist())) < 200 and counts[3] == 58
    _, scratch = run_prefilter_scratch(logits, temperature, top_k, num_cand, chunk, cap, block=64)
    assert scratch.refined.nonzero().flatten().tolist() == refined
    assert scratch.row_flag.nonzero().flatten().tolist() == radix
    assert row_kernel_flags == [radix, radix]
