"""AsyncScheduler with a fake runner driven the way the engine's two-deep batch queue drives it: step N+1 is
scheduled (and executed) before step N's output is processed.

The expectations are worked by hand from the invariants in async_scheduler's docstring, and the whole-run test
checks that async scheduling generates exactly what the synchronous scheduler does.
"""

from collections import deque
from collections.abc import Callable
from typing import Any

import pytest

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

MakeScheduler = Callable[..., Scheduler]
MakeRequest = Callable[..., Request]
RefTokens = Callable[[Request, int], list[int]]


def _launch(runner: Any) -> tuple[SchedulerOutput, ModelRunnerOutput]:
    """Schedule a step and execute it at once (the runner feeds sampled tokens on, as the device does)."""
    runner.num_steps += 1
    out = runner.scheduler.schedule()
    return out, runner.execute(out)


def _run_two_deep(runner: Any, *in_flight: tuple[SchedulerOutput, ModelRunnerOutput]
                  ) -> tuple[dict[str, list[int]], dict[str, FinishReason | None]]:
    """The engine's step_with_batch_queue loop, from the steps `in_flight` on; returns each request's tokens (those
    of the steps it processes) and finish reason."""
    sched = runner.scheduler
    queue = deque(in_flight)
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason | None] = {}
    while sched.has_requests() or queue:
        assert runner.num_steps <= 1000, "requests make no progress"
        while len(queue) < 2 and sched.has_requests():
            out, model_output = _launch(runner)
            if out.total_num_scheduled_tokens or out.finished_req_ids:
                queue.append((out, model_output))
            if not out.total_num_scheduled_tokens:
                break
        if queue:
            outs = sched.update_from_output(*queue.popleft())
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    reasons[o.request_id] = o.finish_reason
    return tokens, reasons


def _update(sched: Scheduler, step: tuple[SchedulerOutput, ModelRunnerOutput]) -> EngineCoreOutputs:
    return sched.update_from_output(*step)


def test_in_flight_tokens_reaching_max_tokens_stop_scheduling(make_scheduler: MakeScheduler,
                                                              request_factory: MakeRequest, fake_runner: Any,
                                                              reference_tokens: RefTokens) -> None:
    sched = make_scheduler(cls=AsyncScheduler)
    r = request_factory("r", 4, max_tokens=3)
    sched.add_request(r)
    runner = fake_runner(sched)
    s1 = _launch(runner)  # the prompt: 4 tokens, samples
    assert s1[0].num_scheduled_tokens == {"r": 4}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (4, 1)
    s2 = _launch(runner)  # 4 tokens + 1 placeholder - 4 computed
    assert s2[0].num_scheduled_tokens == {"r": 1}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (5, 2)
    o1 = _update(sched, s1)
    assert [o.new_token_ids for o in o1.outputs] == [reference_tokens(r, 1)]
    assert r.num_output_placeholders == 1
    s3 = _launch(runner)  # 1 output + 1 placeholder < 3: one more
    assert s3[0].num_scheduled_tokens == {"r": 1}
    assert (r.num_computed_tokens, r.num_output_placeholders) == (6, 2)
    _update(sched, s2)
    assert (r.num_output_tokens, r.num_output_placeholders) == (2, 1)
    s4 = _launch(runner)  # 2 outputs + 1 placeholder reach max_tokens=3: not scheduled
    assert s4[0].num_scheduled_tokens == {} and s4[0].total_num_scheduled_tokens == 0
    assert (r.num_computed_tokens, r.num_output_placeholders) == (6, 1)
    o3 = _update(sched, s3)
    assert o3.outputs[0].finish_reason == FinishReason.LENGTH
    assert r.output_token_ids == reference_tokens(r, 3) and r.num_output_placeholders == 0
    assert sched.requests == {} and sched.running == []
    assert sched.schedule().finished_req_ids == {"r"}


def test_in_flight_tokens_reaching_max_model_len_stop_scheduling(make_scheduler: MakeScheduler,
                                                                 request_factory: MakeRequest,
                                                                 fake_runner: Any) -> None:
    sched = make_scheduler(cls=AsyncScheduler, max_model_len=16)
    r = request_factory("r", 13, max_tokens=100)
    sched.add_request(r)
    runner = fake_runner(sched)
    steps = [_launch(runner), _launch(runner)]  # 13 tokens, then 13 + 1 placeholder = 14 < 16: one token
    assert [s[0].num_scheduled_tokens for s in steps] == [{"r": 13}, {"r": 1}]
    _update(sched, steps.pop(0))
    steps.append(_launch(runner))  # 14 + 1 = 15 < 16: one more
    assert steps[-1][0].num_scheduled_tokens == {"r": 1} and r.num_computed_tokens == 15
    _update(sched, steps.pop(0))
    assert _launch(runner)[0].num_scheduled_tokens == {}  # 15 + 1 placeholder = max_model_len
    outs = _update(sched, steps.pop(0))
    assert outs.outputs[0].finish_reason == FinishReason.LENGTH
    assert (r.num_tokens, r.num_computed_tokens, r.num_output_tokens) == (16, 15, 3)


def test_token_of_the_step_after_a_stop_is_discarded(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                                     fake_runner: Any, reference_tokens: RefTokens) -> None:
    sched = make_scheduler(cls=AsyncScheduler)
    probe = request_factory("a", 4)
    a = request_factory("a", 4, stop_token_ids=[reference_tokens(probe, 1)[0]])
    b = request_factory("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    s1, s2 = _launch(runner), _launch(runner)
    assert s2[0].num_scheduled_tokens == {"a": 1, "b": 1}  # a is computed once more while s1 is in flight
    o1 = _update(sched, s1)
    assert {o.request_id: o.finish_reason for o in o1.outputs} == {"a": FinishReason.STOP, "b": None}
    s3 = _launch(runner)
    assert s3[0].finished_req_ids == {"a"} and s3[0].num_scheduled_tokens == {"b": 1}
    o2 = _update(sched, s2)  # a's token from s2 is dropped; b's is its second
    assert [(o.request_id, o.new_token_ids) for o in o2.outputs] == [("b", reference_tokens(b, 2)[1:])]
    assert a.output_token_ids == reference_tokens(a, 1)


def test_request_preempted_with_a_step_in_flight_gets_its_token(make_scheduler: MakeScheduler,
                                                                request_factory: MakeRequest, fake_runner: Any,
                                                                reference_tokens: RefTokens) -> None:
    # 4 blocks of 4 tokens: two 4-token prompts grow to 8 tokens each (2 blocks); the 9th token needs a third.
    sched = make_scheduler(cls=AsyncScheduler, block_size=4, num_blocks=4, max_model_len=16)
    a = request_factory("a", 4, max_tokens=8)
    b = request_factory("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    steps = [_launch(runner)]
    for _ in range(4):  # each launch schedules both with one placeholder in flight, computing tokens 5..8
        steps.append(_launch(runner))
        _update(sched, steps.pop(0))
    assert a.num_computed_tokens == b.num_computed_tokens == 8 and b.num_output_placeholders == 1
    assert b.num_output_tokens == 4
    s6 = _launch(runner)  # a's 9th token needs a block: b (last running) is preempted with its step in flight
    assert s6[0].num_scheduled_tokens == {"a": 1} and s6[0].finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and list(sched.waiting) == [b]
    outs = _update(sched, steps.pop(0))
    assert {o.request_id: o.new_token_ids for o in outs.outputs} == {"a": reference_tokens(a, 5)[4:],
                                                                      "b": reference_tokens(b, 5)[4:]}
    assert b.output_token_ids == reference_tokens(b, 5) and b.num_output_placeholders == 0
    assert b.status == RequestStatus.PREEMPTED
    _, reasons = _run_two_deep(runner, s6)
    assert a.output_token_ids == reference_tokens(a, 8) and b.output_token_ids == reference_tokens(b, 8)
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert sched.kv_cache_manager.get_num_free_blocks() == 4


def test_sampling_in_an_unexpected_step_is_an_error(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                                    fake_runner: Any) -> None:
    sched = make_scheduler(cls=AsyncScheduler, max_num_batched_tokens=4)
    sched.add_request(request_factory("r", 6))
    out, model_output = _launch(fake_runner(sched))  # a partial prefill: samples nothing, no placeholder
    assert out.num_scheduled_tokens == {"r": 4} and sched.requests["r"].num_output_placeholders == 0
    model_output.sampled_token_ids[model_output.req_id_to_index["r"]] = [7]
    with pytest.raises(AssertionError, match="sampled in a step it was not expected to"):
        sched.update_from_output(out, model_output)


@pytest.mark.parametrize("num_blocks", [1000, 8])
def test_async_generates_what_sync_does(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                        fake_runner: Any, reference_tokens: RefTokens, num_blocks: int) -> None:
    """Chunked prefill, preemption (8 blocks), max_tokens, max_model_len and stop tokens, both ways."""
    specs = [(f"r{i}", 5 + 3 * i, 6 + (5 * i) % 9) for i in range(6)]
    probe = request_factory("r1", 8)
    stop = {"r1": [reference_tokens(probe, 3)[2]]}
    results = {}
    for cls in (Scheduler, AsyncScheduler):
        sched = make_scheduler(cls=cls, block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16,
                               max_model_len=32)
        reqs = [request_factory(rid, plen, max_tokens=mt, stop_token_ids=stop.get(rid)) for rid, plen, mt in specs]
        for r in reqs:
            sched.add_request(r)
        runner = fake_runner(sched)
        if cls is Scheduler:
            tokens = runner.run_to_completion()
            reasons = {r.request_id: r.get_finished_reason() for r in reqs}
        else:
            tokens, reasons = _run_two_deep(runner)
        assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks and sched.requests == {}
        if cls is Scheduler:
            assert all(r.num_output_placeholders == 0 for r in reqs)
        results[cls] = (tokens, reasons, [r.output_token_ids for r in reqs])
    assert results[AsyncScheduler] == results[Scheduler]
    tokens, reasons, _ = results[Scheduler]
    assert reasons["r1"] == FinishReason.STOP and tokens["r1"] == reference_tokens(probe, 3)
    assert reasons["r5"] == FinishReason.LENGTH and len(tokens["r5"]) == 32 - 20  # cut by max_model_len


def test_sync_scheduler_keeps_no_placeholders(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                              fake_runner: Any) -> None:
    sched = make_scheduler()
    reqs = [request_factory(f"r{i}", 3 + i, max_tokens=4) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    runner = fake_runner(sched)
    while sched.has_requests():
        runner.step()
        assert all(r.num_output_placeholders == 0 for r in reqs)
