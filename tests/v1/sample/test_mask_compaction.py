"""The chunked compaction kernel against an independent numpy reference (and the same layout as the
one-program-per-row kernel): ids, full counts and the little-bit-order bitmask, across chunk boundaries."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.ops.mask_compaction import CHUNK, compact_sampling_mask_chunked

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


@pytest.mark.parametrize("tiling", TILINGS[1:])
def test_every_tiling_matches_reference(tiling: tuple[int, int]) -> None:
    chunk, num_warps = tiling
    check_against_reference(2 * CHUNK + 123, 7, {"chunk": chunk, "num_warps": num_warps})


def check_against_reference(vocab: int, k: int, tiling: dict) -> None:
    sizes = [min(s, vocab - 2) for s in (0, 1, 7, max(k - 1, 0), k, k + 1, 2 * k + 50, vocab)]
    logits = make_logits(len(sizes), vocab, sizes, seed=vocab + k)
    num_sampled = torch.ones(len(sizes), dtype=torch.int32)
    num_sampled[2] = 0  # a row that sampled nothing is empty whatever its logits
    token_ids = torch.full((len(sizes), k), -1, dtype=torch.int32, device=DEVICE)
    packed = torch.empty((len(sizes), (vocab + 7) // 8), dtype=torch.uint8, device=DEVICE)
    counts = torch.empty(len(sizes), dtype=torch.int32, device=DEVICE)
    compact_sampling_mask_chunked(logits.to(DEVICE), num_sampled.to(DEVICE), token_ids, packed, counts, **tiling)

    keep = np.isfinite(logits.numpy()) & (num_sampled.numpy() > 0)[:, None]
    np.testing.assert_array_equal(packed.cpu().numpy(), np.packbits(keep, axis=1, bitorder="little"))
    np.testing.assert_array_equal(counts.cpu().numpy(), keep.sum(1))
    ids = token_ids.cpu().numpy()
    for r in range(len(sizes)):
        expected = np.nonzero(keep[r])[0][:k]
        np.testing.assert_array_equal(ids[r, :len(expected)], expected)


def test_row_and_chunked_impls_agree() -> None:
    from vllm.v1.sample.sampling_mask import compact_sampling_mask

    vocab = CHUNK + 517
    sizes = [0, 3, 40, 41, 500, vocab]
    logits = make_logits(len(sizes), vocab, [min(s, vocab - 2) for s in sizes], seed=1).to(DEVICE)
    num_sampled = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.int32, device=DEVICE)
    row = compact_sampling_mask(logits, num_sampled, 40, impl="row")
    chunked = compact_sampling_mask(logits, num_sampled, 40, impl="chunked")
    assert torch.equal(row.counts, chunked.counts)
    assert torch.equal(row.packed_mask, chunked.packed_mask)
    for r, n in enumerate(row.counts.tolist()):
        assert torch.equal(row.token_ids[r, :min(n, 40)], chunked.token_ids[r, :min(n, 40)])
    assert row.tolists().token_ids.tolist() == chunked.tolists().token_ids.tolist()


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
