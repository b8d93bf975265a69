"""Sampling-mask compaction (Triton kernel, interpreted on CPU) vs a numpy reference of the finite set."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.sample.sampling_mask import MAX_COMPACT_SUPPORT, SamplingMaskTensors

V = 4500
# NOTE: on a CUDA machine the kernel runs compiled on the GPU; otherwise interpreted on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def build_rows(sizes: list[int], vocab_size: int, seed: int) -> torch.Tensor:
    """One row per size: `size` random finite ids, -inf elsewhere, plus NaN/+inf noise outside the support."""
    rng = np.random.default_rng(seed)
    logits = torch.full((len(sizes), vocab_size), float("-inf"))
    for r, size in enumerate(sizes):
        ids = rng.permutation(vocab_size)
        logits[r, torch.from_numpy(ids[:size])] = torch.from_numpy(rng.standard_normal(size).astype(np.float32))
        if size <= vocab_size - 2:
            logits[r, int(ids[size])] = float("nan")
            logits[r, int(ids[size + 1])] = float("inf")
    return logits


def reference_supports(logits: torch.Tensor, num_sampled: np.ndarray) -> list[np.ndarray]:
    finite = np.isfinite(logits.numpy())
    return [np.flatnonzero(finite[r]) if num_sampled[r] > 0 else np.empty(0, np.int64)
            for r in range(logits.shape[0])]


def check_mask(mask: SamplingMaskTensors, want: list[np.ndarray], num_kept: int) -> None:
    mask = SamplingMaskTensors(*(t.cpu() for t in mask[:3]), mask.vocab_size)
    counts = mask.counts.numpy()
    assert mask.token_ids.shape == (len(want), num_kept) and mask.token_ids.dtype == torch.int32
    assert counts.tolist() == [len(w) for w in want]
    for r, w in enumerate(want):
        n = min(len(w), num_kept)
        assert np.array_equal(mask.token_ids[r, :n].numpy(), w[:n])
    finite = np.zeros((len(want), mask.vocab_size), dtype=bool)
    for r, w in enumerate(want):
        finite[r, w] = True
    assert np.array_equal(mask.packed_mask.numpy(), np.packbits(finite, axis=1, bitorder="little"))
    lists = mask.tolists()
    assert lists.offsets is not None and lists.offsets.dtype == np.int64 and lists.cu_num_generated_tokens is None
    assert lists.token_ids.dtype == np.int32
    assert [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])] == [w.tolist() for w in want]
    for r, w in enumerate(want):
        assert lists.slice_request(r).to_nested_list() == [w.tolist()]


@pytest.mark.parametrize("max_num_kept", [512, 3000])
def test_kernel_matches_reference_for_every_support_size(max_num_kept: int) -> None:
    num_kept = min(max_num_kept, V, MAX_COMPACT_SUPPORT)
    sizes = [0, 1, 7, num_kept - 1, num_kept, num_kept + 1, MAX_COMPACT_SUPPORT + 300, V, 5]
    logits = build_rows(sizes, V, seed=max_num_kept)
    num_sampled = np.array([1, 1, 1, 1, 1, 1, 1, 1, 0], dtype=np.int32)  # the last row sampled nothing
    mask = SamplingMaskTensors.from_logits(logits.to(DEVICE), torch.from_numpy(num_sampled), max_num_kept)
    want = reference_supports(logits, num_sampled)
    assert len(want[-1]) == 0 and len(want[1]) == 1
    check_mask(mask, want, num_kept)


def test_odd_vocab_strided_logits_and_copy_roundtrip() -> None:
    vocab_size = 1003  # not a multiple of 8 nor of the block size
    wide = build_rows([0, 3, 1003, 500, 999], vocab_size + 5, seed=7)
    logits = wide[:, :vocab_size]  # row stride != vocab size
    num_sampled = np.array([1, 1, 1, 1, 1], dtype=np.int32)
    mask = SamplingMaskTensors.from_logits(logits.to(DEVICE), torch.from_numpy(num_sampled), 100)
    want = reference_supports(logits.contiguous(), num_sampled)
    check_mask(mask, want, 100)
    copied = mask.to_cpu_nonblocking()
    lists = copied.tolists()
    assert np.array_equal(lists.token_ids, mask.tolists().token_ids)


def test_torch_fallback_matches_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = build_rows([0, 4, 40, 41, 700], 777, seed=9)
    num_sampled = torch.tensor([1, 1, 0, 1, 1], dtype=torch.int32)
    kernel = SamplingMaskTensors.from_logits(logits.to(DEVICE), num_sampled, 40)
    kernel = SamplingMaskTensors(*(t.cpu() for t in kernel[:3]), kernel.vocab_size)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    fallback = SamplingMaskTensors.from_logits(logits, num_sampled, 40)
    assert torch.equal(kernel.counts, fallback.counts)
    assert torch.equal(kernel.packed_mask, fallback.packed_mask)
    assert np.array_equal(kernel.tolists().token_ids, fallback.tolists().token_ids)


@pytest.mark.parametrize("use_fast_path", [False, True])
def test_mask_of_real_sampler_keeps_top_k_tie_through_bitmask(use_fast_path: bool) -> None:
    # The general path sizes K by top_k, so the tie past k comes back through the bitmask; the fast path sizes
    # K by its candidate width (top_k plus tie slack), so the same tie comes back from the compact buffer.
    vocab_size = 64
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, vocab_size, generator=gen)
    logits[0] = torch.linspace(3.0, -3.0, vocab_size)
    logits[0, :5] = torch.tensor([6.0, 5.0, 4.0, 4.0, 4.0])
    top_k = torch.tensor([3, 3, 2], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.8, 0.6])
    md = SamplingMetadata(temperature=torch.tensor([1.0, 0.9, 1.2]), all_greedy=False, all_random=True,
                          top_p=top_p, top_k=top_k, min_p=None, max_top_k=3,
                          sampling_mask_rows=torch.tensor([1, 1, 0], dtype=torch.int32))
    out = Sampler("processed_logprobs", use_fast_path=use_fast_path)(logits, md)
    mask = out.sampling_mask
    assert mask is not None
    assert mask.token_ids.shape == (3, 3) if not use_fast_path else mask.token_ids.shape[1] > 3
    processed = Sampler.process_logits(logits, md)
    want = reference_supports(processed, md.sampling_mask_rows.numpy())
    lists = mask.tolists()
    got = [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])]
    assert got[0] == [0, 1, 2, 3, 4]
    assert int(mask.counts[0]) == 5 and got == [w.tolist() for w in want]
    assert got[2] == []
    for r in (0, 1):
        assert int(out.sampled_token_ids[r]) in got[r]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("overflow", [False, True])
def test_cuda_copy_fetches_bitmask_rows_only_on_overflow(overflow: bool) -> None:
    vocab_size = 151552
    sizes = [1, 8, 220, 512, 0] + ([MAX_COMPACT_SUPPORT + 10, 600] if overflow else [])
    logits = build_rows(sizes, vocab_size, seed=13).cuda()
    num_sampled = torch.ones(len(sizes), dtype=torch.int32, device="cuda")
    mask = SamplingMaskTensors.from_logits(logits, num_sampled, 512)
    copy = mask.to_cpu_nonblocking()
    assert copy.tensors.counts.is_pinned() and copy.tensors.packed_mask.is_cuda
    del mask
    lists = copy.tolists()
    want = reference_supports(logits.cpu(), num_sampled.cpu().numpy())
    assert [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])] == [w.tolist() for w in want]
    eager = SamplingMaskTensors.from_logits(logits, num_sampled, 512).to_cpu_nonblocking(copy_packed_mask=True)
    eager.wait()
    assert not eager.tensors.packed_mask.is_cuda
    assert np.array_equal(eager.tolists().token_ids, lists.token_ids)


@pytest.mark.parametrize("overflow", [False, True])
def test_packed_ids_give_the_same_csr_as_the_compact_buffer(overflow: bool) -> None:
    """The CUDA copy's host CSR comes from the ids packed on the device (`pack_rows`, rows past K left out);
    on CPU tensors the same host code must equal the [num_reqs, K] gather, overflow rows included."""
    from vllm.v1.sample.ops.mask_json import pack_rows
    from vllm.v1.sample.sampling_mask import _tolists
    vocab_size = 3000
    sizes = [1, 8, 0, 40, 2] + ([200, 7] if overflow else [])
    logits = build_rows(sizes, vocab_size, seed=5)
    num_sampled = torch.ones(len(sizes), dtype=torch.int32)
    mask = SamplingMaskTensors.from_logits(logits, num_sampled, 64)  # K = 64: the 200-id row overflows
    num_kept = mask.token_ids.shape[1]
    packed = pack_rows(mask.token_ids, torch.where(mask.counts > num_kept, 0, mask.counts))
    got = _tolists(mask, None, packed.numpy())
    want = reference_supports(logits, num_sampled.numpy())
    assert [x.tolist() for x in np.split(got.token_ids, got.offsets[1:-1])] == [w.tolist() for w in want]
    assert got.token_ids.dtype == np.int32
    plain = _tolists(mask, None)
    assert np.array_equal(plain.token_ids, got.token_ids) and np.array_equal(plain.offsets, got.offsets)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_staged_copy_lists_survive_the_slot_reuse() -> None:
    """With a reusable staging slot (the async output copier's), the lists and texts of one step are copies: a
    later step copying into the same slot does not change them; a bigger step grows the slot."""
    from vllm.v1.host_staging import HostStagingSlot
    vocab_size = 151552
    slot = HostStagingSlot()
    steps = [[1, 8, 220, 512, 0], [3, 500, 500, 500, 500, 17, 2, 9]]
    results = []
    for i, sizes in enumerate(steps):
        logits = build_rows(sizes, vocab_size, seed=20 + i).cuda()
        num_sampled = torch.ones(len(sizes), dtype=torch.int32, device="cuda")
        copy = SamplingMaskTensors.from_logits(logits, num_sampled, 512).to_cpu_nonblocking(with_text=True,
                                                                                           staging=slot)
        lists = copy.tolists()
        results.append((lists, copy.text_lists(lists), reference_supports(logits.cpu(), num_sampled.cpu().numpy())))
    for lists, texts, want in results:
        rows = [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])]
        assert rows == [w.tolist() for w in want]
        assert [bytes(t) for t in texts.rows()] == [("[" + ",".join(map(str, r)) + "]").encode() for r in rows]


def test_host_staging_slot_reuses_and_grows_its_buffers() -> None:
    """HostStagingSlot (unpinned here, so on CPU): a copy comes back with the source's dtype, shape and values;
    a smaller copy under the same name reuses the buffer, a larger one grows it; names do not share buffers."""
    from vllm.v1.host_staging import HostStagingSlot
    slot = HostStagingSlot(pin=False)
    a = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    got = slot.copy(a, "x")
    assert got.dtype == torch.int64 and got.shape == (3, 4) and torch.equal(got, a)
    f = torch.tensor([0.5, -1.25], dtype=torch.float32)
    assert torch.equal(slot.copy(f, "y"), f)
    small = slot.copy(torch.tensor([7, 8], dtype=torch.int32), "x")
    assert small.data_ptr() == got.data_ptr() and small.tolist() == [7, 8]
    again = slot.copy(torch.tensor([9, 10], dtype=torch.int32), "x")  # the same (dtype, shape): its kept view
    assert again.data_ptr() == got.data_ptr() and again.tolist() == [9, 10]
    big = torch.arange(100_000, dtype=torch.int32)
    grown = slot.copy(big, "x")
    assert torch.equal(grown, big)
    assert torch.equal(slot.copy(f, "y"), f)  # "y" untouched by "x" growing
    # After growing, every copy under "x" lands in the new buffer, also one of a (dtype, shape) seen before.
    after = slot.copy(torch.tensor([1, 2], dtype=torch.int32), "x")
    assert after.data_ptr() == grown.data_ptr() != got.data_ptr() and after.tolist() == [1, 2]
    # Row counts change step to step over a server's life: the slot keeps one view per name, not one per shape.
    for n in range(1, 300):
        assert slot.copy(torch.arange(n, dtype=torch.int32), "x").tolist() == list(range(n))
        assert slot.copy(torch.full((n, 2), 0.5), "y").shape == (n, 2)
    assert len(slot._views) == 2


def test_lending_slot_is_in_use_while_a_view_lives() -> None:
    """A lending HostStagingSlot (unpinned, on CPU): the numpy views `array` hands out, and every array or
    memoryview derived from them, keep the slot in use; a plain numpy of the copy's tensor does not count; a
    pending step does; a view of a buffer that grew keeps its values (the slot writes only the new buffer)."""
    from vllm.v1.host_staging import HostStagingSlot
    slot = HostStagingSlot(pin=False, lends=True)
    host = slot.copy(torch.arange(10, dtype=torch.int32), "ids")
    slot.copy(torch.zeros(3, dtype=torch.uint8), "text")
    assert not slot.in_use()
    view = slot.array("ids", host)
    assert view.dtype == np.int32 and view.tolist() == list(range(10)) and slot.in_use()
    part = view[2:5].view(np.uint8)
    del view
    assert slot.in_use()
    frame = memoryview(np.ascontiguousarray(part)).cast("B")  # what a zero-copy ZMQ frame holds
    del part
    assert slot.in_use()
    del frame
    assert not slot.in_use()
    plain = host.numpy()
    assert not slot.in_use() and plain.tolist() == list(range(10))
    slot.pending = True
    assert slot.in_use()
    slot.pending = False
    old = slot.array("ids", host)
    slot.copy(torch.arange(100_000, dtype=torch.int32), "ids")  # grows: a new buffer
    assert not slot.in_use() and old.tolist() == list(range(10))


def test_output_copier_takes_a_lending_slot_only_when_free() -> None:
    """AsyncOutputCopier's lending slots (the selection alone, on CPU): a pending slot or one with a live view
    is skipped, a free one is taken again before a new one is made, and none is given past the cap."""
    from vllm.v1.worker import async_output
    copier = async_output.AsyncOutputCopier(torch.device("cpu"), use_thread=False)
    a = copier._lending_slot()
    a.pending = True
    b = copier._lending_slot()
    assert b is not a and copier._lending_slot() is b
    a.pending = False
    assert copier._lending_slot() is a
    held = a.array("ids", a.copy(torch.ones(4, dtype=torch.int32), "ids"))
    assert copier._lending_slot() is b
    kept = [held]
    for _ in range(async_output._MAX_LENDING_SLOTS - 1):
        slot = copier._lending_slot()
        kept.append(slot.array("ids", slot.copy(torch.ones(4, dtype=torch.int32), "ids")))
    assert len(copier._lending) == async_output._MAX_LENDING_SLOTS and copier._lending_slot() is None
    del held, kept[0]
    assert copier._lending_slot() is a


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_output_copier_lends_mask_views_and_keeps_held_outputs_intact() -> None:
    """Steps through AsyncOutputCopier on CUDA, every output held: the first steps' masks are views of lending
    slots, the steps past the cap copy out of the alternating slots; at the end every held output still has its
    own step's ids and texts. Once they are dropped, the slots are taken again (no new one)."""
    from vllm.v1.worker import async_output
    vocab_size = 151552
    copier = async_output.AsyncOutputCopier(torch.device("cuda"), use_thread=True, mask_text=True)
    held, wants = [], []
    num_steps = async_output._MAX_LENDING_SLOTS + 3
    try:
        for step in range(num_steps):
            sizes = [1 + (7 * step + 31 * r) % 600 for r in range(5 + step)]
            logits = build_rows(sizes, vocab_size, seed=40 + step).cuda()
            num_sampled = torch.ones(len(sizes), dtype=torch.int32, device="cuda")
            mask = SamplingMaskTensors.from_logits(logits, num_sampled, 640)
            sampled = torch.zeros(len(sizes), dtype=torch.int64, device="cuda")
            future = copier.submit([f"r{i}" for i in range(len(sizes))], np.ones(len(sizes), dtype=bool), sampled,
                                   None, mask, lambda _sampled: None)
            held.append(future.get_output())
            wants.append(reference_supports(logits.cpu(), num_sampled.cpu().numpy()))
        lent = [out.sampling_masks.token_ids.base for out in held]
        assert sum(a is not None and any(a is s._arrays.get("ids") for s in copier._lending) for a in lent) \
            == async_output._MAX_LENDING_SLOTS
        for out, want in zip(held, wants):
            lists, texts = out.sampling_masks, out.sampling_mask_text
            rows = [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])]
            assert rows == [w.tolist() for w in want]
            assert [bytes(t) for t in texts.rows()] == [("[" + ",".join(map(str, r)) + "]").encode() for r in rows]
        # NOTE: every reference to a lent array keeps its slot in use, the test's own too.
        del lent, lists, texts, out
        held.clear()
        slots = list(copier._lending)
        logits = build_rows([5, 9], vocab_size, seed=99).cuda()
        mask = SamplingMaskTensors.from_logits(logits, torch.ones(2, dtype=torch.int32, device="cuda"), 640)
        out = copier.submit(["a", "b"], np.ones(2, dtype=bool), torch.zeros(2, dtype=torch.int64, device="cuda"),
                            None, mask, lambda _sampled: None).get_output()
        assert copier._lending == slots
        assert any(out.sampling_masks.token_ids.base is s._arrays["ids"] for s in slots)
    finally:
        copier.shutdown()
