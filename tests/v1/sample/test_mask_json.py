"""The sampling mask's JSON text formatted on the device vs `json.dumps` of the same ids (the reference)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vllm.v1.sample.ops.mask_json import format_json_rows, max_text_width

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_rows_match_json_dumps() -> None:
    rng = np.random.default_rng(0)
    num_kept = 40
    rows = [[], [0], [9, 10], [99, 100, 999, 1000, 9999, 10000], [151935], [5, 151935, 1_000_000, 9_999_999]]
    rows += [sorted(rng.choice(151936, size=int(rng.integers(1, num_kept + 1)), replace=False).tolist())
             for _ in range(30)]
    rows.append(list(range(num_kept)))  # exactly K ids
    counts = [len(r) for r in rows] + [num_kept + 5]  # the last row overflows K: formatted on the host
    token_ids = np.full((len(counts), num_kept), -3, dtype=np.int32)  # junk past each row's count
    for i, r in enumerate(rows):
        token_ids[i, :len(r)] = r
    text, lengths = format_json_rows(torch.from_numpy(token_ids).to(DEVICE), torch.tensor(counts).to(DEVICE))
    assert text.shape == (len(counts), max_text_width(num_kept)) and text.dtype == torch.uint8
    text_np, lengths_np = text.cpu().numpy(), lengths.cpu().numpy()
    for i, r in enumerate(rows):
        assert text_np[i, :lengths_np[i]].tobytes() == json.dumps(r, separators=(",", ":")).encode(), i
    assert lengths_np[-1] == -1


def test_no_rows_and_no_columns() -> None:
    text, lengths = format_json_rows(torch.zeros((0, 8), dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
    assert text.shape == (0, max_text_width(8)) and lengths.shape == (0,)
    text, lengths = format_json_rows(torch.zeros((2, 0), dtype=torch.int32), torch.tensor([0, 3]))
    assert text[0, :2].tolist() == list(b"[]") and lengths.tolist() == [2, -1]


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "text_only"])
def test_copy_text_lists_match_the_lists_including_overflow_rows(with_ids: bool) -> None:
    """SamplingMaskCopy.text_lists (device text packed back to back, overflow rows formatted on the host) gives,
    row by row, json.dumps of the same row of tolists() (the copy with the ids); a copy without the ids gives the
    same texts (overflow rows formatted from their bitmask rows) and lists of the same offsets with no ids."""
    from vllm.v1.sample.sampling_mask import SamplingMaskTensors

    rng = np.random.default_rng(1)
    vocab, num_reqs = 3000, 6
    logits = np.full((num_reqs, vocab), -np.inf, dtype=np.float32)
    for r, size in enumerate([0, 3, 16, 17, 200, 5]):  # K = 16: rows of 17 and 200 overflow to the bitmask
        logits[r, rng.choice(vocab, size=size, replace=False)] = rng.standard_normal(size)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32)
    num_sampled[5] = 0  # sampled nothing: an empty row
    mask = SamplingMaskTensors.from_logits(torch.from_numpy(logits).to(DEVICE), num_sampled.to(DEVICE), 16)
    lists = mask.to_cpu_nonblocking().tolists()
    copy = mask.to_cpu_nonblocking(with_text=True, with_ids=with_ids)
    got = copy.tolists()
    assert got.offsets.tolist() == lists.offsets.tolist()
    assert (got.token_ids is None) is not with_ids
    text = copy.text_lists(got)
    assert text is not None and len(text.offsets) == num_reqs + 1
    rows = text.rows()
    for r in range(num_reqs):
        ids = lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]].tolist()
        assert len(ids) == [0, 3, 16, 17, 200, 0][r]
        assert rows[r].tobytes() == json.dumps(ids, separators=(",", ":")).encode(), r
    assert mask.to_cpu_nonblocking().text_lists(lists) is None
    with pytest.raises(ValueError, match="with_ids=False"):
        mask.to_cpu_nonblocking(with_ids=False)


def test_kernels_match_the_torch_formatter() -> None:
    """json_rows_packed (Triton, interpreted on CPU) gives the bytes and lengths of format_json_rows +
    pack_rows (torch), including overflow rows, ids of 7 and 8 digits (8: left to the host) and K = 1."""
    from vllm.v1.sample.ops.mask_json import format_json_rows, json_rows_packed, pack_rows_torch

    rng = np.random.default_rng(2)
    for num_kept in (1, 5, 37):
        rows = [sorted(rng.choice(151936, size=int(rng.integers(0, num_kept + 1)), replace=False).tolist())
                for _ in range(9)]
        rows[0] = [9_999_999][:num_kept]
        rows[1] = [3, 10_000_000][:num_kept]
        counts = [len(r) for r in rows] + [num_kept + 1]
        token_ids = np.zeros((len(counts), num_kept), dtype=np.int32)
        for i, r in enumerate(rows):
            token_ids[i, :len(r)] = r
        ids_t, counts_t = torch.from_numpy(token_ids).to(DEVICE), torch.tensor(counts, dtype=torch.int32).to(DEVICE)
        text, lengths = json_rows_packed(ids_t, counts_t)
        ref_text, ref_lengths = format_json_rows(ids_t, counts_t)
        ref_packed = pack_rows_torch(ref_text, ref_lengths)
        assert lengths.tolist() == ref_lengths.tolist()
        total = int(lengths.clamp(min=0).sum())
        assert text[:total].tolist() == ref_packed[:total].tolist()
        pos = 0
        for r, n in zip(rows, lengths.tolist()):
            if n < 0:
                assert max(r, default=0) >= 10 ** 7
                continue
            assert text[pos:pos + n].cpu().numpy().tobytes() == json.dumps(r, separators=(",", ":")).encode()
            pos += n


def test_pack_rows_kernel_matches_torch() -> None:
    """pack_rows (one Triton launch; interpreted on CPU) == pack_rows_torch == a hand-packed reference, with empty
    rows, negative lengths and lengths past the width (rows past K) taking no room."""
    from vllm.v1.sample.ops.mask_json import pack_rows, pack_rows_torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.arange(5 * 7, dtype=torch.int32).reshape(5, 7)
    lengths = torch.tensor([3, 0, -1, 8, 7], dtype=torch.int32)
    want = [0, 1, 2] + list(range(28, 35))
    for fn in (pack_rows, pack_rows_torch):
        got = fn(values.to(device), lengths.to(device)).cpu()
        assert got.shape == (35,) and got[:10].tolist() == want


@pytest.mark.parametrize("row_block", [4, 1024])
def test_packing_kernels_across_row_blocks(monkeypatch: pytest.MonkeyPatch, row_block: int) -> None:
    """The packing offset is summed over fixed blocks of rows (`_ROW_BLOCK`, so one compiled kernel serves every
    batch size): with 4-row blocks, 11 rows span three blocks and rows start at, after and inside block edges;
    pack_rows and json_rows_packed match the torch versions (and json.dumps) either way."""
    from vllm.v1.sample.ops import mask_json
    from vllm.v1.sample.ops.mask_json import format_json_rows, json_rows_packed, pack_rows, pack_rows_torch

    monkeypatch.setattr(mask_json, "_ROW_BLOCK", row_block)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(5)
    num_kept = 6
    counts = rng.integers(0, num_kept + 1, 11)
    counts[[3, 8]] = [num_kept + 2, 0]  # a row past K (no room) and an empty one
    token_ids = np.sort(rng.integers(0, 151936, (11, num_kept)), axis=1).astype(np.int32)
    ids_t, counts_t = torch.from_numpy(token_ids).to(device), torch.from_numpy(counts.astype(np.int32)).to(device)
    assert pack_rows(ids_t, counts_t).cpu()[:int(counts[counts <= num_kept].sum())].tolist() == \
        pack_rows_torch(ids_t.cpu(), counts_t.cpu())[:int(counts[counts <= num_kept].sum())].tolist()
    text, lengths = json_rows_packed(ids_t, counts_t)
    ref_text, ref_lengths = format_json_rows(ids_t.cpu(), counts_t.cpu())
    assert lengths.cpu().tolist() == ref_lengths.tolist()
    pos = 0
    for r in range(11):
        n = int(lengths[r])
        if n < 0:
            assert r == 3
            continue
        row = token_ids[r, :counts[r]].tolist()
        assert text[pos:pos + n].cpu().numpy().tobytes() == json.dumps(row, separators=(",", ":")).encode(), r
        pos += n


@pytest.mark.parametrize("row_block", [4, 1024])
def test_grouped_packing_puts_each_group_together(monkeypatch: pytest.MonkeyPatch, row_block: int) -> None:
    """json_rows_packed with a row group (each row's API server; padding rows MASK_GROUP_PAD) packs the texts in
    (group, row) order: == the torch formatter + pack_rows_torch with the group == json.dumps of the rows
    concatenated in that order, rows left to the host (past K) taking no room; with 4-row blocks the groups' rows
    are spread over three blocks."""
    from vllm.v1.sample.metadata import MASK_GROUP_PAD
    from vllm.v1.sample.ops import mask_json
    from vllm.v1.sample.ops.mask_json import format_json_rows, json_rows_packed, pack_rows_torch

    monkeypatch.setattr(mask_json, "_ROW_BLOCK", row_block)
    rng = np.random.default_rng(7)
    num_kept, num_reqs = 5, 11
    counts = rng.integers(0, num_kept + 1, num_reqs)
    counts[[2, 6]] = [num_kept + 3, 0]  # a row past K and an empty one
    token_ids = np.sort(rng.integers(0, 151936, (num_reqs, num_kept)), axis=1).astype(np.int32)
    group = np.array([2, 0, 1, 0, 2, 2, 1, 0, 1, MASK_GROUP_PAD, MASK_GROUP_PAD], dtype=np.int32)
    counts[group == MASK_GROUP_PAD] = 0  # padding rows sample nothing
    ids_t, counts_t = torch.from_numpy(token_ids).to(DEVICE), torch.from_numpy(counts.astype(np.int32)).to(DEVICE)
    text, lengths = json_rows_packed(ids_t, counts_t, torch.from_numpy(group).to(DEVICE))
    ref_text, ref_lengths = format_json_rows(ids_t.cpu(), counts_t.cpu())
    assert lengths.cpu().tolist() == ref_lengths.tolist()
    order = sorted(range(num_reqs), key=lambda r: (group[r], r))
    want = b"".join(json.dumps(token_ids[r, :counts[r]].tolist(), separators=(",", ":")).encode()
                    for r in order if counts[r] <= num_kept)
    assert text[:len(want)].cpu().numpy().tobytes() == want
    torch_packed = pack_rows_torch(ref_text, ref_lengths, torch.from_numpy(group))
    assert torch_packed[:len(want)].numpy().tobytes() == want


@pytest.mark.parametrize("with_ids", [True, False], ids=["ids", "text_only"])
def test_copy_text_lists_with_groups(with_ids: bool) -> None:
    """SamplingMaskCopy.text_lists of a grouped text: rows() are still in row order (== json.dumps of each row of
    tolists()), each group's rows are consecutive in the packing (rank), with and without rows that overflow K
    (formatted on the host: then everything comes back in row order); the same from a mask prepacked and copied
    without its ids."""
    from vllm.v1.sample.sampling_mask import SamplingMaskTensors

    rng = np.random.default_rng(3)
    vocab, num_reqs = 3000, 7
    group = torch.tensor([1, 0, 2, 1, 0, 0, 2], dtype=torch.int32)
    for sizes in ([4, 3, 16, 1, 9, 2, 5], [4, 3, 17, 1, 200, 2, 5]):  # K = 16; the second has two overflows
        logits = np.full((num_reqs, vocab), -np.inf, dtype=np.float32)
        for r, size in enumerate(sizes):
            logits[r, rng.choice(vocab, size=size, replace=False)] = rng.standard_normal(size)
        mask = SamplingMaskTensors.from_logits(torch.from_numpy(logits).to(DEVICE),
                                               torch.ones(num_reqs, dtype=torch.int32).to(DEVICE), 16)
        lists = mask.to_cpu_nonblocking().tolists()
        copy = mask.prepack(True, group.to(DEVICE), with_ids=with_ids).to_cpu_nonblocking(with_text=True,
                                                                                           with_ids=with_ids)
        got = copy.tolists()
        assert got.offsets.tolist() == lists.offsets.tolist() and (got.token_ids is None) is not with_ids
        text = copy.text_lists(got)
        assert text is not None
        for r, row in enumerate(text.rows()):
            ids = lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]].tolist()
            assert len(ids) == sizes[r] and row.tobytes() == json.dumps(ids, separators=(",", ":")).encode(), r
        if max(sizes) <= 16:
            assert text.rank is not None
            for g in range(3):
                packed = sorted(text.rank[(group == g).numpy()].tolist())
                assert packed == list(range(packed[0], packed[0] + len(packed)))
            assert text.rank.tolist() == [3, 0, 5, 4, 1, 2, 6]
        else:
            assert text.rank is None


def test_prepack_and_copy_refuse_layouts_they_cannot_give() -> None:
    """A mask prepacked without its ids cannot be copied with them, one prepacked without its text cannot be
    copied with it, a prepack or copy with neither ids nor text is refused, and so is a copy without the ids where
    the vocabulary has ids of more than 7 digits (formatted from the ids on the host)."""
    from vllm.v1.sample.sampling_mask import SamplingMaskTensors

    logits = torch.full((2, 64), float("-inf"))
    logits[0, :5] = 0.0
    mask = SamplingMaskTensors.from_logits(logits.to(DEVICE), None, 8)
    with pytest.raises(ValueError, match="without its ids"):
        mask.prepack(True, with_ids=False).to_cpu_nonblocking(with_text=True)
    with pytest.raises(ValueError, match="without its JSON text"):
        mask.prepack(False).to_cpu_nonblocking(with_text=True)
    with pytest.raises(ValueError, match="ids or its JSON text"):
        mask.prepack(False, with_ids=False)
    copy = mask.prepack(True, with_ids=False).to_cpu_nonblocking(with_text=True, with_ids=False)
    assert copy.tolists().offsets.tolist() == [0, 5, 5]
    # A vocabulary with ids of 8 digits: the device leaves rows with such ids to the host, which needs their ids.
    from vllm.v1.sample.sampling_mask import mask_ids_needed
    assert mask_ids_needed(True, 10 ** 7) is False and mask_ids_needed(True, 10 ** 7 + 1) is True
    assert mask_ids_needed(False, 1000) is True
    with pytest.raises(ValueError, match="more than 7 digits"):
        mask._replace(vocab_size=10 ** 7 + 1).to_cpu_nonblocking(with_text=True, with_ids=False)
    assert [bytes(t) for t in copy.text_lists(copy.tolists()).rows()] == [b"[0,1,2,3,4]", b"[]"]
