"""The chunked compaction kernel (compiled on CUDA, interpreted on CPU) and its torch code (the CPU engine's path)
against an independent numpy reference, and against each other: ids, full counts and the little-bit-order bitmask,
across chunk boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.ops.mask_compaction import CHUNK, compact_sampling_mask_chunked, compact_sampling_mask_torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_logits(num_reqs: int, vocab: int, supports: list[int], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    logits = np.full((num_reqs, vocab), -np.inf, dtype=np.float32)
    for r, size in enumerate(supports):
        ids = rng.choice(vocab, size=size, replace=False)
        logits[r, ids] = rng.standard_normal(size)
        # Non-finite values outside the support: NaN and +inf are not kept.
        others = np.setdiff1d(np.arange(vocab), ids)
        if len(others) >= 2:
            logits[r, others[0]] = np.nan
            logits[r, others[-1]] = np.inf
    return torch.from_numpy(logits)


# (chunk, num_warps): the default tiling, then other chunk widths and warp counts.
TILINGS = [(CHUNK, 8), (CHUNK, 4), (1024, 2), (8192, 8)]


@pytest.mark.parametrize("vocab", [2 * CHUNK + 123, CHUNK, 100])
@pytest.mark.parametrize("k", [1, 7, 300])
def test_chunked_compaction_matches_reference(vocab: int, k: int) -> None:
    check_against_reference(vocab, k, {})


@pytest.mark.parametrize("vocab", [2 * CHUNK + 123, 100])
@pytest.mark.parametrize("k", [1, 300])
def test_torch_code_matches_reference(vocab: int, k: int) -> None:
    check_against_reference(vocab, k, None)


@pytest.mark.parametrize("tiling", TILINGS[1:])
def test_every_tiling_matches_reference(tiling: tuple[int, int]) -> None:
    chunk, num_warps = tiling
    check_against_reference(2 * CHUNK + 123, 7, {"chunk": chunk, "num_warps": num_warps})


def check_against_reference(vocab: int, k: int, tiling: dict | None) -> None:
    """The kernel with `tiling` (keyword arguments), or the torch code with None, against numpy."""
    sizes = [min(s, vocab - 2) for s in (0, 1, 7, max(k - 1, 0), k, k + 1, 2 * k + 50, vocab)]
    logits = make_logits(len(sizes), vocab, sizes, seed=vocab + k)
    num_sampled = torch.ones(len(sizes), dtype=torch.int32)
    num_sampled[2] = 0  # a row that sampled nothing is empty whatever its logits
    token_ids = torch.full((len(sizes), k), -1, dtype=torch.int32, device=DEVICE)
    packed = torch.empty((len(sizes), (vocab + 7) // 8), dtype=torch.uint8, device=DEVICE)
    counts = torch.empty(len(sizes), dtype=torch.int32, device=DEVICE)
    if tiling is None:
        compact_sampling_mask_torch(logits.to(DEVICE), num_sampled.to(DEVICE), token_ids, packed, counts)
    else:
        compact_sampling_mask_chunked(logits.to(DEVICE), num_sampled.to(DEVICE), token_ids, packed, counts,
                                      **tiling)

    keep = np.isfinite(logits.numpy()) & (num_sampled.numpy() > 0)[:, None]
    np.testing.assert_array_equal(packed.cpu().numpy(), np.packbits(keep, axis=1, bitorder="little"))
    np.testing.assert_array_equal(counts.cpu().numpy(), keep.sum(1))
    ids = token_ids.cpu().numpy()
    for r in range(len(sizes)):
        expected = np.nonzero(keep[r])[0][:k]
        np.testing.assert_array_equal(ids[r, :len(expected)], expected)


def test_kernel_matches_torch_code() -> None:
    """compact_sampling_mask (the chunked kernels here: interpreted on CPU, compiled on CUDA) == the torch code
    the CPU engine runs, on rows that sample nothing, fit K, overflow K and keep the whole vocabulary; and both
    give the same host lists."""
    import triton

    from vllm.v1.sample.sampling_mask import SamplingMaskTensors, compact_sampling_mask

    vocab, k = CHUNK + 517, 40
    sizes = [0, 3, 40, 41, 500, vocab]
    logits = make_logits(len(sizes), vocab, [min(s, vocab - 2) for s in sizes], seed=1)
    num_sampled = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int32)
    assert logits.device.type == "cpu"
    if DEVICE == "cpu":
        assert triton.knobs.runtime.interpret  # tests/conftest.py: the kernels run interpreted
    kernel = compact_sampling_mask(logits.to(DEVICE), num_sampled.to(DEVICE), k)
    kernel = SamplingMaskTensors(*(t.cpu() for t in kernel[:3]), kernel.vocab_size)
    token_ids = torch.full((len(sizes), k), -1, dtype=torch.int32)
    packed = torch.empty((len(sizes), (vocab + 7) // 8), dtype=torch.uint8)
    counts = torch.empty(len(sizes), dtype=torch.int32)
    compact_sampling_mask_torch(logits, num_sampled, token_ids, packed, counts)
    assert counts.tolist() == [0, 3, 0, 41, 500, vocab - 2]
    assert torch.equal(kernel.counts, counts)
    assert torch.equal(kernel.packed_mask, packed)
    for r, n in enumerate(counts.tolist()):
        assert torch.equal(kernel.token_ids[r, :min(n, k)], token_ids[r, :min(n, k)])
    torch_mask = SamplingMaskTensors(token_ids, packed, counts, vocab)
    assert kernel.tolists().token_ids.tolist() == torch_mask.tolists().token_ids.tolist()


@pytest.mark.parametrize("use_kernel", [True, False])
def test_compact_candidates_matches_reference(use_kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path's candidate compaction (kernel: compiled on CUDA or interpreted; torch ops on CPU without the
    interpreter) against a numpy reference: kept = value > -inf (NaN and -inf removed), ids in order, rows whose
    mask is not wanted empty, K smaller than some rows' support."""
    import triton

    from vllm.v1.sample.ops.mask_compaction import compact_candidates
    if not use_kernel:
        if DEVICE == "cuda":
            pytest.skip("the torch branch runs only on CPU tensors")
        monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    rng = np.random.default_rng(3)
    num_reqs, num_cand, num_kept = 6, 37, 20
    values = rng.standard_normal((num_reqs, num_cand)).astype(np.float32)
    values[rng.random((num_reqs, num_cand)) < 0.4] = -np.inf
    values[0, 3] = np.nan
    values[1] = -np.inf  # nothing kept
    values[2, :] = 1.0  # every candidate kept: more than K
    ids = np.sort(rng.choice(1000, size=(num_reqs, num_cand)), axis=1).astype(np.int32)
    mask_rows = np.array([1, 1, 1, 0, 1, 1], dtype=np.int32)
    token_ids, counts = compact_candidates(torch.from_numpy(values).to(DEVICE), torch.from_numpy(ids).to(DEVICE),
                                           torch.from_numpy(mask_rows).to(DEVICE), num_kept)
    token_ids, counts = token_ids.cpu().numpy(), counts.cpu().numpy()
    for r in range(num_reqs):
        kept = ids[r][values[r] > -np.inf] if mask_rows[r] else ids[r][:0]
        assert counts[r] == len(kept)
        n = min(len(kept), num_kept)
        assert token_ids[r, :n].tolist() == kept[:n].tolist()
    assert counts[2] == num_cand and counts[3] == 0 and counts[1] == 0


@pytest.mark.parametrize("kernel", [True, False])
def test_compaction_into_rows_writes_only_hit_rows(kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """compact_sampling_mask_into (the sampler's general path writing its recomputed rows into the fast path's
    mask): sub-batch row i lands in batch row rows[i] only where hit[i], reading that batch row's num_sampled;
    every other batch row keeps its ids, count and bitmask bytes. Against a numpy reference; the Triton kernels
    (compiled on CUDA, interpreted on CPU) and the torch ops of CPU runs without the interpreter."""
    import triton

    from vllm.v1.sample.sampling_mask import SamplingMaskTensors, compact_sampling_mask_into
    if not kernel:
        if DEVICE == "cuda":
            pytest.skip("the torch ops run only on CPU tensors outside the interpreter")
        monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    num_reqs, vocab, k = 6, CHUNK + 37, 5
    sizes = [3, 9, 0, 4, 2]  # the sub-batch's supports; 9 > K overflows to the bitmask
    logits = make_logits(len(sizes), vocab, sizes, seed=11)
    rows = torch.tensor([4, 0, 2, 5, 1])  # batch row of each sub-batch row
    hit = torch.tensor([True, True, False, True, True])
    mask_rows = torch.tensor([1, 1, 1, 1, 1, 0], dtype=torch.int32)  # batch row 5 wants no mask
    # The batch's mask before: recognisable values in every row.
    token_ids = torch.arange(num_reqs * k, dtype=torch.int32).view(num_reqs, k) + 1000
    counts = torch.full((num_reqs,), 3, dtype=torch.int32)
    packed = torch.full((num_reqs, (vocab + 7) // 8), 0xA5, dtype=torch.uint8)
    before = (token_ids.clone(), counts.clone(), packed.clone())
    dst = SamplingMaskTensors(token_ids.to(DEVICE), packed.to(DEVICE), counts.to(DEVICE), vocab)
    compact_sampling_mask_into(logits.to(DEVICE), mask_rows.to(DEVICE), dst, rows.to(DEVICE), hit.to(DEVICE))

    got_ids, got_counts, got_packed = dst.token_ids.cpu(), dst.counts.cpu(), dst.packed_mask.cpu()
    written = {int(r) for r, h in zip(rows, hit) if h}
    assert written == {4, 0, 5, 1}
    for r in range(num_reqs):
        if r not in written:  # batch rows 2 (not hit) and 3 (not in the sub-batch) untouched
            assert torch.equal(got_ids[r], before[0][r]) and got_counts[r] == before[1][r]
            assert torch.equal(got_packed[r], before[2][r])
    for i, r in enumerate(rows.tolist()):
        if not hit[i]:
            continue
        keep = np.isfinite(logits[i].numpy()) & bool(mask_rows[r] > 0)
        assert got_counts[r] == keep.sum()
        np.testing.assert_array_equal(got_packed[r].numpy(), np.packbits(keep, bitorder="little"))
        expected = np.nonzero(keep)[0][:k]
        np.testing.assert_array_equal(got_ids[r, :len(expected)].numpy(), expected)
    assert got_counts[5] == 0  # mask not wanted: empty even though its logits keep 2 ids
    assert got_counts[0] == 9  # overflow row: the full count, its bitmask row written
