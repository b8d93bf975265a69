"""DeferredMasks (the engine core's default: AsyncOutputCopier.defer_mask_lists): a step's mask lists built later on the caller's thread, except
for steps with rows past K, which the output thread builds at once (their bitmask rows are read from the device,
whose buffers a later step rewrites); the lending slot stays pending until built or released."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.v1.sample.test_sampling_mask import build_rows, reference_supports
from vllm.v1.host_staging import HostStagingSlot
from vllm.v1.sample.sampling_mask import SamplingMaskTensors
from vllm.v1.worker import async_output


@pytest.mark.parametrize("overflow", [False, True])
def test_deferred_lists_equal_the_reference(overflow: bool) -> None:
    sizes = [3, 0, 12] + ([90] if overflow else [])
    logits = build_rows(sizes, 1000, seed=3)
    num_sampled = torch.ones(len(sizes), dtype=torch.int32)
    mask = SamplingMaskTensors.from_logits(logits, num_sampled, 16)  # K = 16: the 90-id row overflows
    copier = async_output.AsyncOutputCopier(torch.device("cpu"), use_thread=True)
    copier.defer_mask_lists = True
    out = copier.submit([f"r{i}" for i in range(len(sizes))], np.ones(len(sizes), dtype=bool),
                        torch.arange(len(sizes)), None, mask, lambda _: None).get_output()
    copier.shutdown()
    deferred = out.pending_masks
    assert out.sampling_masks is None and isinstance(deferred, async_output.DeferredMasks)
    # The output thread built an overflowing step's lists already, and only those.
    assert (deferred._built is not None) is overflow
    lists, text = deferred.build()
    assert text is None
    want = reference_supports(logits, num_sampled.numpy())
    assert [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])] == [w.tolist() for w in want]
    with pytest.raises(AssertionError):
        deferred.build()


@pytest.mark.parametrize("defer", [False, True], ids=["thread", "deferred"])
def test_text_only_copier_gives_sizes_and_texts_without_ids(defer: bool) -> None:
    """An API server's engine (AsyncOutputCopier(mask_text=True,
    mask_ids=False)): the step's lists carry no ids but every row's size, and the texts are each row's reference
    support as JSON, the row past K (formatted from its bitmask row) included; deferred or not."""
    sizes = [3, 0, 12, 90, 1]
    logits = build_rows(sizes, 1000, seed=5)
    num_sampled = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    mask = SamplingMaskTensors.from_logits(logits, num_sampled, 16)  # K = 16: the 90-id row overflows
    copier = async_output.AsyncOutputCopier(torch.device("cpu"), use_thread=True, mask_text=True, mask_ids=False)
    copier.defer_mask_lists = defer
    out = copier.submit([f"r{i}" for i in range(len(sizes))], np.ones(len(sizes), dtype=bool),
                        torch.arange(len(sizes)), None, mask, lambda _: None).get_output()
    copier.shutdown()
    lists, texts = out.pending_masks.build() if defer else (out.sampling_masks, out.sampling_mask_text)
    want = reference_supports(logits, num_sampled.numpy())
    assert lists.token_ids is None and np.diff(lists.offsets).tolist() == [len(w) for w in want]
    assert [bytes(t) for t in texts.rows()] == [("[" + ",".join(map(str, w.tolist())) + "]").encode() for w in want]
    with pytest.raises(ValueError, match="mask_text"):
        async_output.AsyncOutputCopier(torch.device("cpu"), use_thread=False, mask_text=False, mask_ids=False)


def test_lending_slot_is_pending_until_built_or_released() -> None:
    mask = SamplingMaskTensors.from_logits(build_rows([2, 5], 200, seed=1), None, 8)
    for finish in ("build", "release"):
        slot = HostStagingSlot(pin=False, lends=True)
        slot.pending = True
        deferred = async_output.DeferredMasks(mask.to_cpu_nonblocking(), slot)
        deferred.build_now_if_overflow()
        assert slot.pending and slot.in_use()
        getattr(deferred, finish)()
        assert not slot.pending
        deferred.release()  # a second release changes nothing
        assert not slot.pending and deferred.done
    # Dropped without either (outputs never resolved): the slot is freed when the object goes.
    slot = HostStagingSlot(pin=False, lends=True)
    slot.pending = True
    deferred = async_output.DeferredMasks(mask.to_cpu_nonblocking(), slot)
    del deferred
    assert not slot.pending


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mask_ids", [True, False], ids=["ids", "text_only"])
def test_cuda_deferred_lists_survive_the_device_buffers_being_rewritten(mask_ids: bool) -> None:
    """On CUDA, with the JSON text: two steps go through the copier (the second while the first's lists are still
    deferred, so it takes another lending slot), one with a row past K; once get_output() returned, every device
    buffer of both masks is overwritten (as later steps' sampler graphs do, the bitmask included) and only then
    are the lists built: each still holds its own step's ids and texts (the overflowing step's were built by
    the output thread), and each slot stays pending until its build. Without the ids copied (mask_ids False):
    the lists are the sizes only, the texts the same."""
    vocab_size = 151552
    copier = async_output.AsyncOutputCopier(torch.device("cuda"), use_thread=True, mask_text=True, mask_ids=mask_ids)
    copier.defer_mask_lists = True
    steps = []
    try:
        for step, sizes in enumerate([[3, 410, 77, 1, 250], [12, 900, 5, 64]]):  # K = 640: 900 ids overflow
            logits = build_rows(sizes, vocab_size, seed=70 + step).cuda()
            num_sampled = torch.ones(len(sizes), dtype=torch.int32, device="cuda")
            mask = SamplingMaskTensors.from_logits(logits, num_sampled, 640).prepack(True, with_ids=mask_ids)
            out = copier.submit([f"r{i}" for i in range(len(sizes))], np.ones(len(sizes), dtype=bool),
                                torch.zeros(len(sizes), dtype=torch.int64, device="cuda"), None, mask,
                                lambda _sampled: None).get_output()
            deferred = out.pending_masks
            assert isinstance(deferred, async_output.DeferredMasks) and deferred.lent is not None
            assert deferred.lent.pending and (deferred._built is not None) is (step == 1)
            steps.append((mask, deferred, reference_supports(logits.cpu(), num_sampled.cpu().numpy())))
        assert steps[0][1].lent is not steps[1][1].lent
        for mask, _, _ in steps:
            assert (mask.packed_ids is None) is not mask_ids
            for t in (mask.token_ids, mask.counts, mask.packed_mask, mask.packed_ids, mask.text, mask.text_lengths):
                if t is not None:
                    t.fill_(7)  # what later steps' graph replays would do to these static outputs
        torch.cuda.synchronize()
        for _, deferred, want in steps:
            lists, texts = deferred.build()
            assert not deferred.lent.pending
            assert np.diff(lists.offsets).tolist() == [len(w) for w in want]
            if not mask_ids:
                assert lists.token_ids is None
                rows = [w.tolist() for w in want]
            else:
                rows = [x.tolist() for x in np.split(lists.token_ids, lists.offsets[1:-1])]
            assert rows == [w.tolist() for w in want]
            assert [bytes(t) for t in texts.rows()] == [("[" + ",".join(map(str, r)) + "]").encode() for r in rows]
    finally:
        copier.shutdown()
