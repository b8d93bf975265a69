"""update_from_output routes each request its own logprobs and sampling-mask rows (hand-built CSR, numpy).

The step's ModelRunnerOutput rows are deliberately in a different order from the scheduler's, and one row is
a chunked-prefill piece that sampled nothing (an empty mask row).
"""

from collections.abc import Callable

import numpy as np
import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, SamplingMaskText, StepRowSettings
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


def update(sched: Scheduler, out: SchedulerOutput, runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
    """update_from_output, then each output's logprob and mask rows two ways: sliced in process
    (materialize_step_rows) and after the wire's step-level packing (one numpy gather) and unpacking; both must
    agree."""
    outs = sched.update_from_output(out, runner_output)
    wire = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outs))
    outs.materialize_step_rows()
    assert outs.step_logprobs is None and outs.step_masks is None
    assert [o.request_id for o in wire.outputs] == [o.request_id for o in outs.outputs]
    for got, want in zip(wire.outputs, outs.outputs):
        if want.new_sampling_mask is None:
            assert got.new_sampling_mask is None
        else:
            assert got.new_sampling_mask.to_nested_list() == want.new_sampling_mask.to_nested_list()
        if want.new_logprobs is None:
            assert got.new_logprobs is None
        else:
            for g, w in zip(got.new_logprobs[:3], want.new_logprobs[:3]):
                assert g == np.asarray(w).tolist()
    return outs


def logprobs_for(rows: int) -> LogprobsLists:
    ids = np.arange(rows * 2, dtype=np.int32).reshape(rows, 2) + 1000
    return LogprobsLists(ids, -ids.astype(np.float32) / 1000, np.arange(1, rows + 1, dtype=np.int32))


@pytest.mark.parametrize("row_settings", [False, True], ids=["requests", "runner_rows"])
def test_three_requests_each_receive_their_own_mask_row(make_scheduler: Callable[..., Scheduler],
                                                         request_factory: Callable[..., Request],
                                                         row_settings: bool) -> None:
    """Routing and stats from the requests' settings, or from the runner's per-row ones (StepRowSettings, what
    the model runner gives): the same."""
    sched = make_scheduler(max_num_batched_tokens=24)
    for rid, top_k in zip("abc", (1, 3, 4)):
        sched.add_request(request_factory(rid, 4, logprobs=1, top_k=top_k))
    # e opts out of masks and asks no logprobs; d's 30-token prompt only gets a chunk this step.
    sched.add_request(request_factory("e", 4, top_k=3, return_sampling_mask=False))
    sched.add_request(request_factory("d", 30, logprobs=1, top_k=5))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 4, "b": 4, "c": 4, "e": 4, "d": 8}

    req_ids = ["e", "d", "a", "c", "b"]
    sampled = {"c": [7], "d": [], "a": [5], "e": [11], "b": [6]}
    # a: 2 ids past its top_k of 1 (a tie), b: 4 past 3.
    rows = {"c": [1, 7, 9], "d": [], "a": [0, 5], "e": [11, 12], "b": [2, 3, 6, 8]}
    offsets = np.cumsum([0] + [len(rows[r]) for r in req_ids]).astype(np.int64)
    masks = SamplingMaskLists(np.array([t for r in req_ids for t in rows[r]], dtype=np.int32), offsets, None)
    logprobs = logprobs_for(len(req_ids))
    runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                      sampled_token_ids=[sampled[r] for r in req_ids], logprobs=logprobs,
                                      sampling_masks=masks)
    if row_settings:  # in the runner's row order: e d a c b (e asks no logprobs and opts out of masks)
        runner_output.row_settings = StepRowSettings(np.array([0, 1, 1, 1, 1], dtype=bool),
                                                     np.array([0, 1, 1, 1, 1], dtype=bool),
                                                     np.array([3, 5, 1, 4, 3], dtype=np.int32))
    outs = update(sched, out, runner_output)

    by_id = {o.request_id: o for o in outs.outputs}
    assert set(by_id) == {"a", "b", "c", "e"}  # d sampled nothing
    for rid in "abc":
        o = by_id[rid]
        row = req_ids.index(rid)
        assert o.new_token_ids == sampled[rid]
        assert o.new_sampling_mask.offsets is None
        assert o.new_sampling_mask.token_ids.dtype == np.int32
        assert o.new_sampling_mask.token_ids.tolist() == rows[rid]
        assert sampled[rid][0] in o.new_sampling_mask.to_nested_list()[0]
        np.testing.assert_array_equal(o.new_logprobs.logprob_token_ids, logprobs.logprob_token_ids[row:row + 1])
        np.testing.assert_array_equal(o.new_logprobs.logprobs, logprobs.logprobs[row:row + 1])
        assert o.new_logprobs.sampled_token_ranks.tolist() == [row + 1]
        assert o.finish_reason is None and o.num_cached_tokens == 0
    assert by_id["e"].new_sampling_mask is None and by_id["e"].new_logprobs is None
    stats = outs.scheduler_stats
    assert stats is not None
    assert stats.sampling_mask_sizes == [2, 4, 3]  # a, b, c in scheduling order
    assert stats.num_sampling_mask_overflow_rows == 2  # a and b
    assert stats.num_running_reqs == 5 and stats.num_waiting_reqs == 0


def test_text_only_masks_give_texts_and_sizes(make_scheduler: Callable[..., Scheduler],
                                             request_factory: Callable[..., Request]) -> None:
    """An API server's engine without the ids copied: the runner's lists carry
    the sizes only (token_ids None) beside the texts; each request gets its own text row and no ids, in process
    and over the wire alike, and the stats count the sizes."""
    sched = make_scheduler()
    for rid in "ab":
        sched.add_request(request_factory(rid, 4, top_k=2))
    sched.add_request(request_factory("c", 4, top_k=2, return_sampling_mask=False))
    out = sched.schedule()
    req_ids = ["b", "c", "a"]
    rows = {"b": [3, 8, 9], "c": [4], "a": [5]}  # b: a top-k tie, 3 > 2
    texts = [("[" + ",".join(map(str, rows[r])) + "]").encode() for r in req_ids]
    text_offsets = np.cumsum([0] + [len(t) for t in texts]).astype(np.int64)
    runner_output = ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[rows[r][0]] for r in req_ids],
        sampling_masks=SamplingMaskLists(None, np.cumsum([0] + [len(rows[r]) for r in req_ids]).astype(np.int64)),
        sampling_mask_text=SamplingMaskText(np.frombuffer(b"".join(texts), dtype=np.uint8), text_offsets))
    outs = sched.update_from_output(out, runner_output)
    assert outs.scheduler_stats.sampling_mask_sizes == [1, 3]  # a, b in scheduling order
    assert outs.scheduler_stats.num_sampling_mask_overflow_rows == 1
    wire = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outs))
    outs.materialize_step_rows()
    for got in (outs, wire):
        by_id = {o.request_id: o for o in got.outputs}
        for rid in "ab":
            assert by_id[rid].new_sampling_mask is None
            assert bytes(by_id[rid].new_sampling_mask_text.text) == texts[req_ids.index(rid)]
        assert by_id["c"].new_sampling_mask is None and by_id["c"].new_sampling_mask_text is None


def test_multi_token_step_slices_positions_and_cuts_at_stop(make_scheduler: Callable[..., Scheduler],
                                                            request_factory: Callable[..., Request]) -> None:
    sched = make_scheduler()
    sched.add_request(request_factory("a", 3, logprobs=0, top_k=2))
    sched.add_request(request_factory("b", 3, logprobs=0, top_k=2, eos_token_id=2))
    out = sched.schedule()
    # Positions: a owns 0-1, b owns 2-4; b hits EOS at its 2nd token, so its 3rd is dropped with its mask.
    cu = [0, 2, 5]
    masks = SamplingMaskLists(np.array([1, 5, 6, 7, 2, 4, 9, 10], dtype=np.int32),
                              np.array([0, 2, 3, 4, 6, 8], dtype=np.int64), cu)
    logprobs = logprobs_for(5)._replace(cu_num_generated_tokens=cu)
    runner_output = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                                      sampled_token_ids=[[5, 6], [7, 2, 9]], logprobs=logprobs, sampling_masks=masks)
    outs = update(sched, out, runner_output)
    a, b = outs.outputs
    assert a.new_token_ids == [5, 6] and a.new_sampling_mask.to_nested_list() == [[1, 5], [6]]
    assert b.new_token_ids == [7, 2] and b.new_sampling_mask.to_nested_list() == [[7], [2, 4]]
    assert b.finish_reason == FinishReason.STOP
    assert b.new_logprobs.sampled_token_ranks.tolist() == [3, 4]
    assert outs.scheduler_stats.sampling_mask_sizes == [2, 1, 1, 2]
    assert outs.scheduler_stats.num_sampling_mask_overflow_rows == 0
    assert [r.request_id for r in sched.running] == ["a"]
    assert sched.schedule().finished_req_ids == {"b"}


def test_no_masks_or_logprobs_when_runner_has_none(make_scheduler: Callable[..., Scheduler],
                                                   request_factory: Callable[..., Request]) -> None:
    sched = make_scheduler()
    sched.add_request(request_factory("a", 3, logprobs=2, top_k=2))
    out = sched.schedule()
    outs = update(sched, out, ModelRunnerOutput(["a"], {"a": 0}, [[4]]))
    (o,) = outs.outputs
    assert o.new_token_ids == [4] and o.new_logprobs is None and o.new_sampling_mask is None
    assert outs.scheduler_stats.sampling_mask_sizes == []
    assert 0.0 < outs.scheduler_stats.kv_cache_usage < 1.0


class FakeDeferredMasks:
    """The runner's deferred masks (async_output.DeferredMasks): built or released once."""

    def __init__(self, masks: SamplingMaskLists) -> None:
        self.masks, self.calls = masks, []

    def build(self) -> tuple[SamplingMaskLists, None]:
        self.calls.append("build")
        return self.masks, None

    def release(self) -> None:
        self.calls.append("release")


def test_deferred_masks_resolve_to_the_same_rows_and_stats(make_scheduler: Callable[..., Scheduler],
                                                           request_factory: Callable[..., Request]) -> None:
    """Deferred mask lists (the engine core's only path): the update leaves a PendingStepMasks and no mask sizes;
    resolve_step_rows builds the lists once and gives the rows and stats an undeferred update gives."""
    from vllm.v1.outputs import PendingStepMasks
    results = {}
    for deferred in (False, True):
        sched = make_scheduler()
        for rid in "abc":
            sched.add_request(request_factory(rid, 4, top_k=3))
        sched.add_request(request_factory("e", 4, top_k=3, return_sampling_mask=False))
        out = sched.schedule()
        req_ids = ["c", "a", "e", "b"]
        rows = {"c": [1, 7, 9], "a": [0, 5], "e": [11, 12], "b": [2, 3, 6, 8]}  # b: a top-k tie, 4 > 3
        offsets = np.cumsum([0] + [len(rows[r]) for r in req_ids]).astype(np.int64)
        masks = SamplingMaskLists(np.array([t for r in req_ids for t in rows[r]], dtype=np.int32), offsets, None)
        fake = FakeDeferredMasks(masks)
        runner_output = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                          sampled_token_ids=[[rows[r][-1]] for r in req_ids],
                                          sampling_masks=None if deferred else masks,
                                          pending_masks=fake if deferred else None)
        outs = sched.update_from_output(out, runner_output)
        if deferred:
            assert isinstance(outs.step_masks, PendingStepMasks) and fake.calls == []
            assert outs.scheduler_stats.sampling_mask_sizes == []
        outs.resolve_step_rows()
        assert fake.calls == (["build"] if deferred else [])
        stats = outs.scheduler_stats
        results[deferred] = (stats.sampling_mask_sizes, stats.num_sampling_mask_overflow_rows)
        outs.materialize_step_rows()
        assert {o.request_id: None if o.new_sampling_mask is None else o.new_sampling_mask.token_ids.tolist()
                for o in outs.outputs} == {"a": rows["a"], "b": rows["b"], "c": rows["c"], "e": None}
    assert results[True] == results[False] == ([2, 4, 3], 1)


def test_deferred_masks_no_output_carries_are_released(make_scheduler: Callable[..., Scheduler],
                                                       request_factory: Callable[..., Request]) -> None:
    sched = make_scheduler()
    sched.add_request(request_factory("e", 4, top_k=3, return_sampling_mask=False))
    out = sched.schedule()
    fake = FakeDeferredMasks(SamplingMaskLists(np.array([4, 5], dtype=np.int32), np.array([0, 2]), None))
    outs = sched.update_from_output(out, ModelRunnerOutput(["e"], {"e": 0}, [[5]], pending_masks=fake))
    assert fake.calls == ["release"] and outs.step_masks is None
    outs.resolve_step_rows()
    assert fake.calls == ["release"] and outs.scheduler_stats.sampling_mask_sizes == []
