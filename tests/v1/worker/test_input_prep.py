"""InputBuffers.prepare on a hand-worked batch: flat metadata, scheduler order, CUDA-graph padding, and the
device-side feed of the previous step's sampled ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.input_batch import InputBatch
from vllm.v1.worker.input_prep import InputBuffers

BLOCK_SIZE = 4
SCRATCH = 9


def _batch() -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=16, max_num_blocks_per_req=4, vocab_size=100,
                       device=torch.device("cpu"), return_sampling_mask=False)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    # Row 0: a 5-token prompt in blocks 3, 7, nothing computed.
    batch.add_request(NewRequestData("a", [10, 11, 12, 13, 14], [], params, [3, 7], 0))
    # Row 1: 3 prompt tokens and 1 output token (resumed), 3 computed, block 5.
    batch.add_request(NewRequestData("b", [20, 21, 22], [23], params, [5], 3))
    return batch


def _buffers() -> InputBuffers:
    return InputBuffers(max_num_reqs=4, max_num_tokens=16, max_model_len=16, max_num_blocks_per_req=4,
                        block_size=BLOCK_SIZE, scratch_block=SCRATCH, device=torch.device("cpu"))


def _so(num_scheduled: dict[str, int]) -> SchedulerOutput:
    return SchedulerOutput([], CachedRequestData(), num_scheduled, sum(num_scheduled.values()), set())


def test_mixed_step_in_scheduler_order() -> None:
    batch, buffers = _batch(), _buffers()
    inp = buffers.prepare(batch, _so({"b": 1, "a": 5}), pad_to=None, num_splits=None)
    assert inp.req_ids == ["b", "a"]
    assert inp.rows.tolist() == [1, 0]
    md = inp.attn_metadata
    assert (md.num_actual_tokens, md.num_reqs, md.max_query_len, md.max_seq_len) == (6, 2, 5, 5)
    assert md.query_start_loc.tolist() == [0, 1, 6]
    assert inp.positions.tolist() == [3, 0, 1, 2, 3, 4]
    assert inp.input_ids.tolist() == [23, 10, 11, 12, 13, 14]
    # b: block 5 offset 3; a: block 3 offsets 0-3, then block 7 offset 0.
    assert md.slot_mapping.tolist() == [23, 12, 13, 14, 15, 28]
    assert md.seq_lens.tolist() == [4, 5]
    assert md.block_table[:, :2].tolist() == [[5, 0], [3, 7]]
    assert inp.logits_indices.tolist() == [0, 5]
    assert inp.samples.tolist() == [True, True]


def test_partial_prefill_does_not_sample() -> None:
    batch, buffers = _batch(), _buffers()
    inp = buffers.prepare(batch, _so({"a": 3}), pad_to=None, num_splits=None)
    assert inp.positions.tolist() == [0, 1, 2]
    assert inp.samples.tolist() == [False]


def test_decode_padding_rows_use_the_scratch_block() -> None:
    batch, buffers = _batch(), _buffers()
    buffers.block_table.np[:] = 77  # stale rows from earlier steps
    inp = buffers.prepare(batch, _so({"b": 1}), pad_to=4, num_splits=2)
    md = inp.attn_metadata
    assert (md.num_actual_tokens, md.num_reqs, md.max_query_len, md.num_splits) == (4, 4, 1, 2)
    assert md.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inp.input_ids.tolist() == [23, 0, 0, 0]
    assert inp.positions.tolist() == [3, 0, 0, 0]
    assert md.slot_mapping.tolist() == [23] + [SCRATCH * BLOCK_SIZE] * 3
    assert md.seq_lens.tolist() == [4, 1, 1, 1]
    assert md.block_table[:, 0].tolist() == [5, SCRATCH, SCRATCH, SCRATCH]
    assert inp.num_reqs == 1 and inp.samples.tolist() == [True]


def test_padding_rejects_prefill() -> None:
    with pytest.raises(ValueError, match="pure-decode"):
        _buffers().prepare(_batch(), _so({"a": 5}), pad_to=4, num_splits=None)


def test_previous_sampled_ids_feed_the_next_inputs() -> None:
    batch, buffers = _batch(), _buffers()
    # b sampled in the previous step at index 2 of its sampled ids: its newest token (position 3) is on the device.
    batch.prev_sampled_idx[1] = 2
    batch.token_ids_cpu[1, 3] = -5
    inp = buffers.prepare(batch, _so({"a": 5, "b": 1}), pad_to=None, num_splits=None)
    buffers.apply_prev_sampled(torch.tensor([7, 8, 99]))
    assert inp.input_ids.tolist() == [10, 11, 12, 13, 14, 99]


def test_rows_move_with_their_state() -> None:
    batch = _batch()
    batch.prev_sampled_idx[1] = 4
    batch.remove_request("a")
    assert batch.req_id_to_index == {"b": 0}
    assert batch.prev_sampled_idx[0] == 4 and batch.num_tokens[0] == 4
    np.testing.assert_array_equal(batch.token_ids_cpu[0, :4], [20, 21, 22, 23])


def test_mixed_padding_hand_worked() -> None:
    batch, buffers = _batch(), _buffers()
    buffers.block_table.np[:] = 77  # stale rows from earlier steps
    inp = buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=11, pad_reqs=4)
    md = inp.attn_metadata
    assert (md.num_actual_tokens, md.num_reqs, md.max_query_len, md.max_seq_len, md.num_splits) == (11, 4, 11, 16, 1)
    assert (inp.num_actual_tokens, inp.num_padded, inp.num_padded_tokens, inp.num_reqs) == (6, None, 11, 2)
    # Real requests first; the padding request owns tokens 6..10; row 3 has no tokens.
    assert md.query_start_loc.tolist() == [0, 1, 6, 11, 11]
    assert inp.input_ids.tolist() == [23, 10, 11, 12, 13, 14, 0, 0, 0, 0, 0]
    assert inp.positions.tolist() == [3, 0, 1, 2, 3, 4, 0, 0, 0, 0, 0]
    s = SCRATCH * BLOCK_SIZE
    assert md.slot_mapping.tolist() == [23, 12, 13, 14, 15, 28, s, s + 1, s + 2, s + 3, s]
    assert md.seq_lens.tolist() == [4, 5, 5, 0]
    assert md.block_table[2].tolist() == [SCRATCH] * 4
    assert md.block_table[3].tolist() == [77] * 4  # a zero-token row's block-table row is never read
    assert inp.logits_indices.tolist() == [0, 5] and inp.samples.tolist() == [True, True]


def test_mixed_padding_without_padding_tokens_and_default_rows() -> None:
    batch, buffers = _batch(), _buffers()
    inp = buffers.prepare(batch, _so({"a": 3, "b": 1}), None, None, pad_tokens=4)
    md = inp.attn_metadata
    assert buffers.max_num_rows == 5 and (md.num_actual_tokens, md.num_reqs) == (4, 5)
    assert md.query_start_loc.tolist() == [0, 3, 4, 4, 4, 4]
    assert md.seq_lens.tolist() == [3, 4, 0, 0, 0]
    assert inp.samples.tolist() == [False, True] and inp.logits_indices.tolist() == [2, 3]


def test_mixed_padding_longer_than_max_model_len() -> None:
    """Padding tokens beyond max_model_len (16) go to further padding requests, never past a block-table row."""
    batch = _batch()
    buffers = InputBuffers(max_num_reqs=4, max_num_tokens=40, max_model_len=16, max_num_blocks_per_req=4,
                           block_size=BLOCK_SIZE, scratch_block=SCRATCH, device=torch.device("cpu"))
    inp = buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=40, pad_reqs=5)
    md = inp.attn_metadata
    assert md.query_start_loc.tolist() == [0, 1, 6, 22, 38, 40]
    assert md.seq_lens.tolist() == [4, 5, 16, 16, 2]
    assert md.block_table[2:].tolist() == [[SCRATCH] * 4] * 3
    s = SCRATCH * BLOCK_SIZE
    assert md.slot_mapping[6:].tolist() == [s + i % 4 for i in range(16)] * 2 + [s, s + 1]
    with pytest.raises(ValueError, match="do not fit"):
        buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=40, pad_reqs=3)


def test_mixed_padding_rejects_bad_shapes() -> None:
    batch, buffers = _batch(), _buffers()
    with pytest.raises(ValueError, match="more tokens or requests"):
        buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=5, pad_reqs=4)
    with pytest.raises(ValueError, match="more tokens or requests"):
        buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=8, pad_reqs=6)
    with pytest.raises(ValueError, match="do not fit"):  # padding tokens but no spare row
        buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=8, pad_reqs=2)
    with pytest.raises(ValueError, match="either"):
        buffers.prepare(batch, _so({"b": 1}), 2, None, pad_tokens=8)
    # Exactly the real tokens and rows: nothing to pad, no spare row needed.
    inp = buffers.prepare(batch, _so({"b": 1, "a": 5}), None, None, pad_tokens=6, pad_reqs=2)
    assert inp.attn_metadata.query_start_loc.tolist() == [0, 1, 6]


def test_fill_dummy_mixed() -> None:
    buffers = _buffers()
    buffers.fill_dummy_mixed(10, 3)
    md = buffers.mixed_metadata(10, 3)
    assert md.query_start_loc.tolist() == [0, 10, 10, 10] and md.seq_lens.tolist() == [10, 0, 0]
    assert md.block_table[0].tolist() == [SCRATCH] * 4
    assert buffers.slot_mapping.np[:10].tolist() == [SCRATCH * BLOCK_SIZE + i % 4 for i in range(10)]
