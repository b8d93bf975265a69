"""msgspec round trips of the engine-core protocol, numpy arrays included (dtype, shape, byte order, values)."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists
from vllm.v1.serial_utils import AUX_FRAME_MIN_BYTES, NDARRAY_EXT_CODE, MsgpackDecoder, MsgpackEncoder


@pytest.mark.parametrize("arr", [
    np.arange(12, dtype=np.int32).reshape(3, 4),
    np.array([[-0.5, -1.25], [0.0, -np.inf]], dtype=np.float32),
    np.arange(6, dtype=">i8").reshape(2, 3),
    np.zeros((0, 5), dtype=np.int64),
    np.array([1, 2, 255], dtype=np.uint8),
    np.arange(20, dtype=np.float64).reshape(4, 5)[:, ::2],  # non-contiguous
])
def test_ndarray_round_trip(arr: np.ndarray) -> None:
    out = MsgpackDecoder().decode(MsgpackEncoder().encode({"a": arr}))["a"]
    assert out.dtype == arr.dtype
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_ndarray_is_an_extension_of_raw_bytes() -> None:
    arr = np.arange(1000, dtype=np.int32)
    data = MsgpackEncoder().encode(arr)
    ext = msgspec.msgpack.decode(data)
    assert isinstance(ext, msgspec.msgpack.Ext) and ext.code == NDARRAY_EXT_CODE
    # The raw little-endian buffer is inside the payload verbatim (no per-element encoding).
    assert arr.tobytes() in bytes(ext.data)
    assert len(data) < arr.nbytes + 64


def test_object_arrays_are_refused() -> None:
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(np.array([object()], dtype=object))


def test_engine_core_request_round_trip() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, stop=["\n"], stop_token_ids=[7], seed=3,
                            max_tokens=9, logprobs=2, output_kind=RequestOutputKind.DELTA,
                            return_sampling_mask=False)
    request = EngineCoreRequest("req-1", [1, 2, 3], params, 2, 123.5)
    out = MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request))
    assert out.request_id == "req-1" and out.prompt_token_ids == [1, 2, 3]
    assert out.eos_token_id == 2 and out.arrival_time == 123.5
    p = out.sampling_params
    assert (p.temperature, p.top_k, p.top_p, p.stop, p.seed, p.max_tokens, p.logprobs) == (
        0.7, 5, 0.9, ["\n"], 3, 9, 2)
    assert p.output_kind is RequestOutputKind.DELTA
    assert p.return_sampling_mask is False
    assert p.all_stop_token_ids == {7}
    assert p.output_text_buffer_length == 0


def test_engine_core_outputs_round_trip_restores_named_tuples() -> None:
    lp = LogprobsLists(np.array([[5, 1, 2]], np.int32), np.array([[-0.1, -2.0, -3.5]], np.float32),
                       np.array([1], np.int32), None)
    mask = SamplingMaskLists(np.array([1, 5, 9], np.int32), None, None)
    multi = SamplingMaskLists(np.array([3, 4, 8], np.int32), np.array([0, 2, 3], np.int64), None)
    lp2 = LogprobsLists(np.array([[4, 4, 0], [8, 2, 8]], np.int32),
                        np.array([[-0.5, -0.5, -4.0], [-1.5, -0.25, -1.5]], np.float32), np.array([1, 2], np.int32))
    outputs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("a", [5], lp, mask, FinishReason.STOP, "x"),
                 EngineCoreOutput("b", [4, 8], None, multi, None),
                 EngineCoreOutput("c", []),
                 EngineCoreOutput("e", [4, 8], lp2, None)],
        scheduler_stats=SchedulerStats(2, 1, 0.25, 0, [3, 2, 1], 1),
        finished_requests={"d"})
    data = MsgpackEncoder().encode(outputs)
    # The step's arrays travel as a few extension payloads, not one per output and field.
    assert bytes(data).count(b"<i4") + bytes(data).count(b"<f4") + bytes(data).count(b"<i8") <= 6
    assert outputs.step_arrays is None and outputs.outputs[0].new_logprobs is lp  # encoding left it alone
    got = MsgpackDecoder(EngineCoreOutputs).decode(data)
    a, b, c, e = got.outputs
    assert got.step_arrays is None
    # Logprobs come back as Python numbers (float32 values exactly), row p = position p.
    assert isinstance(a.new_logprobs, LogprobsLists)
    assert a.new_logprobs.logprob_token_ids == [[5, 1, 2]] and a.new_logprobs.sampled_token_ranks == [1]
    assert a.new_logprobs.logprobs == lp.logprobs.tolist()
    assert e.new_logprobs.logprob_token_ids == [[4, 4, 0], [8, 2, 8]]
    assert e.new_logprobs.logprobs == lp2.logprobs.tolist() and e.new_logprobs.sampled_token_ranks == [1, 2]
    assert e.new_sampling_mask is None
    assert isinstance(a.new_sampling_mask, SamplingMaskLists)
    assert a.new_sampling_mask.token_ids.dtype == np.int32
    assert a.new_sampling_mask.to_nested_list() == [[1, 5, 9]]
    assert a.finish_reason is FinishReason.STOP and a.stop_reason == "x"
    assert b.new_sampling_mask.to_nested_list() == [[3, 4], [8]]
    assert b.new_logprobs is None and b.finish_reason is None
    assert c.new_token_ids == [] and c.new_sampling_mask is None
    assert got.scheduler_stats == outputs.scheduler_stats
    assert got.finished_requests == {"d"}


def test_large_arrays_travel_in_frames_of_their_own() -> None:
    big = np.arange(AUX_FRAME_MIN_BYTES // 4 + 3, dtype=np.int32)  # over the threshold
    big2d = np.arange(2 * AUX_FRAME_MIN_BYTES, dtype=np.float64).reshape(-1, 4)[:, ::2]  # non-contiguous
    small = np.array([1, 2, 3], dtype=np.int16)
    frames = MsgpackEncoder().encode_frames({"big": big, "small": small, "big2d": big2d})
    assert len(frames) == 3
    # The message holds no array bytes but the small one's; the frames are the arrays' raw buffers.
    assert len(frames[0]) < 200
    assert bytes(frames[1]) == big.tobytes() and bytes(frames[2]) == np.ascontiguousarray(big2d).tobytes()
    # What ZMQ delivers: the frames as separate buffers (copies here).
    out = MsgpackDecoder().decode(bytes(frames[0]), [bytes(f) for f in frames[1:]])
    for key, want in (("big", big), ("small", small), ("big2d", big2d)):
        assert out[key].dtype == want.dtype and out[key].shape == want.shape
        np.testing.assert_array_equal(out[key], want)
    with pytest.raises(ValueError, match="frame 2 missing"):
        MsgpackDecoder().decode(bytes(frames[0]), [bytes(frames[1])])


def test_step_masks_over_frames_match_the_inline_encoding() -> None:
    """A 64-row step with 300-id masks: encode_frames moves the mask ids out of the message, the decoded outputs
    equal the single-message encoding's."""
    rng = np.random.default_rng(1)
    rows = [np.sort(rng.choice(5000, 300, replace=False)).astype(np.int32) for _ in range(64)]
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput(f"r{i}", [int(r[0])], None, SamplingMaskLists(r, None))
                                         for i, r in enumerate(rows)])
    encoder = MsgpackEncoder()
    frames = encoder.encode_frames(outputs)
    assert len(frames) == 2  # 64 * 300 * 4 bytes of ids
    got = MsgpackDecoder(EngineCoreOutputs).decode(frames[0], frames[1:])
    inline = MsgpackDecoder(EngineCoreOutputs).decode(encoder.encode(outputs))
    for g, w, row in zip(got.outputs, inline.outputs, rows):
        assert g.request_id == w.request_id and g.new_token_ids == w.new_token_ids
        assert g.new_sampling_mask.to_nested_list() == w.new_sampling_mask.to_nested_list() == [row.tolist()]


def test_step_level_logprobs_beside_an_output_with_its_own_mask() -> None:
    """Step-level logprobs (StepLogprobs) and a mask carried by one output itself (a hand-built output; the
    scheduler makes both step-level): both arrive, the mask as SamplingMaskLists."""
    from vllm.v1.outputs import StepLogprobs

    lists = LogprobsLists(np.array([[5, 1], [7, 7], [2, 3]], np.int32),
                          np.array([[-0.5, -1.0], [-0.25, -0.25], [-2.0, -0.75]], np.float32),
                          np.array([2, 1, 3], np.int32), None)
    # Output 0 owns position 2, output 1 positions 0-1.
    step = StepLogprobs(lists, np.array([0, 1]), np.array([2, 0]), np.array([1, 2]))
    mask = SamplingMaskLists(np.array([2, 6, 9], np.int32), None, None)
    outputs = EngineCoreOutputs(outputs=[EngineCoreOutput("a", [2], None, mask), EngineCoreOutput("b", [5, 7])],
                                step_logprobs=step)
    got = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    a, b = got.outputs
    assert isinstance(a.new_sampling_mask, SamplingMaskLists)
    assert a.new_sampling_mask.to_nested_list() == [[2, 6, 9]] and b.new_sampling_mask is None
    assert a.new_logprobs.logprob_token_ids == [[2, 3]] and a.new_logprobs.sampled_token_ranks == [3]
    assert b.new_logprobs.logprob_token_ids == [[5, 1], [7, 7]] and b.new_logprobs.sampled_token_ranks == [2, 1]
