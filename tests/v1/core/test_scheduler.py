"""Scheduler with a fake model runner: batching limits, chunked prefill, decode, preemption, aborts.

The reference for generated tokens (`reference_tokens`) is `history_token` applied step by step to the prompt, which is what an
unbatched, never-preempted run produces.
"""

from collections.abc import Callable
from typing import Any

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

MakeScheduler = Callable[..., Scheduler]
MakeRequest = Callable[..., Request]
RefTokens = Callable[[Request, int], list[int]]


def test_continuous_batching_respects_max_num_seqs(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                                   fake_runner: Any, reference_tokens: RefTokens) -> None:
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    reqs = [request_factory(f"r{i}", 3 + i, max_tokens=2 + i) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    runner = fake_runner(sched)
    tokens: dict[str, list[int]] = {}
    while sched.has_requests():
        num_running_before = len(sched.running)
        out, outs = runner.step()
        assert len(out.num_scheduled_tokens) <= 2
        if num_running_before < 2 and sched.waiting:
            # A free seat is filled in the very next step.
            assert len(out.scheduled_new_reqs) >= 1
        for o in outs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert runner.max_batch_reqs == 2
    for r in reqs:
        assert tokens[r.request_id] == reference_tokens(r, r.max_tokens)
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.requests == {} and sched.kv_cache_manager.get_num_free_blocks() == 1000


def test_token_budget_is_shared_in_order(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                         fake_runner: Any) -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    for i in range(3):
        sched.add_request(request_factory(f"r{i}", 6))
    runner = fake_runner(sched)
    out, outs = runner.step()
    # r0's whole prompt, then a 4-token chunk of r1; no budget left for r2.
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 4}
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r0", "r1"]
    assert [o.request_id for o in outs.outputs] == ["r0"]
    assert [r.request_id for r in sched.waiting] == ["r2"]
    out, outs = runner.step()
    # Running first (r0 decodes 1, r1 finishes its prompt with 2), then r2 gets a 7-token budget for 6.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 2, "r2": 6}
    assert out.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    assert out.scheduled_cached_reqs.num_computed_tokens == [6, 4]
    assert [n.req_id for n in out.scheduled_new_reqs] == ["r2"]
    assert sorted(o.request_id for o in outs.outputs) == ["r0", "r1", "r2"]
    assert out.total_num_scheduled_tokens == 9


def test_chunked_prefill_samples_only_on_last_chunk(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                                    fake_runner: Any, reference_tokens: RefTokens) -> None:
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    req = request_factory("long", 25, max_tokens=3)
    sched.add_request(req)
    runner = fake_runner(sched)
    chunks, computed_before, new_blocks, emitted = [], [], [], []
    while sched.has_requests():
        out, outs = runner.step()
        chunks.append(out.num_scheduled_tokens.get("long", 0))
        if out.scheduled_new_reqs:
            computed_before.append(out.scheduled_new_reqs[0].num_computed_tokens)
            new_blocks.append(len(out.scheduled_new_reqs[0].block_ids))
        elif out.scheduled_cached_reqs.num_reqs:
            computed_before.append(out.scheduled_cached_reqs.num_computed_tokens[0])
            new_blocks.append(len(out.scheduled_cached_reqs.new_block_ids[0]))
        emitted.append([t for o in outs.outputs for t in o.new_token_ids])
    assert chunks == [8, 8, 8, 1, 1, 1, 0]  # last step only flushes finished_req_ids
    assert computed_before == [0, 8, 16, 24, 25, 26]
    # Blocks cover 8, 16, 24, 25, 26, 27 tokens: 2, 4, 6, 7, 7, 7 blocks in total.
    assert new_blocks == [2, 2, 2, 1, 0, 0]
    assert emitted[:3] == [[], [], []]
    assert [t for e in emitted for t in e] == reference_tokens(req, 3)
    assert all(len(e) == 1 for e in emitted[3:6])


def test_decode_one_token_per_step(make_scheduler: MakeScheduler, request_factory: MakeRequest, fake_runner: Any,
                                   reference_tokens: RefTokens) -> None:
    sched = make_scheduler()
    reqs = [request_factory("a", 5, max_tokens=4), request_factory("b", 7, max_tokens=6)]
    for r in reqs:
        sched.add_request(r)
    runner = fake_runner(sched)
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 5, "b": 7}
    for step in range(1, 4):
        out, outs = runner.step()
        assert out.num_scheduled_tokens == {"a": 1, "b": 1}
        assert all(len(o.new_token_ids) == 1 for o in outs.outputs)
    finished = [o for o in outs.outputs if o.finished]
    assert [o.request_id for o in finished] == ["a"] and finished[0].finish_reason == FinishReason.LENGTH
    assert [r.request_id for r in sched.running] == ["b"]
    out, _ = runner.step()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    runner.run_to_completion()
    assert reqs[1].output_token_ids == reference_tokens(reqs[1], 6)


def test_decode_allocates_a_block_only_at_block_boundaries(make_scheduler: MakeScheduler,
                                                            request_factory: MakeRequest, fake_runner: Any) -> None:
    # Blocks of 4 tokens. a's 3-token prompt fills 3 slots of its first block, b's 4-token prompt fills its first.
    sched = make_scheduler(block_size=4)
    a = request_factory("a", 3, max_tokens=12)
    b = request_factory("b", 4, max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    out, _ = runner.step()
    assert [len(r.block_ids) for r in out.scheduled_new_reqs] == [1, 1]
    # Each decode step computes the token at position num_computed_tokens; it needs a new block exactly when
    # that position is a multiple of 4: a computes positions 3, 4, 5, ..., b computes 4, 5, 6, ...
    new_blocks: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(10):
        out, _ = runner.step()
        cached = out.scheduled_cached_reqs
        assert out.num_scheduled_tokens == {"a": 1, "b": 1}
        for req_id, blocks in zip(cached.req_ids, cached.new_block_ids):
            new_blocks[req_id].append(len(blocks))
    assert new_blocks["a"] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert new_blocks["b"] == [1, 0, 0, 0, 1, 0, 0, 0, 1, 0]
    assert len(sched.kv_cache_manager.get_block_ids("a")) == 4  # 3 + 10 tokens computed (13 slots)
    assert len(sched.kv_cache_manager.get_block_ids("b")) == 4  # 4 + 10 tokens computed (14 slots)


def test_decode_at_a_block_boundary_preempts_when_the_pool_is_empty(make_scheduler: MakeScheduler,
                                                                    request_factory: MakeRequest,
                                                                    fake_runner: Any) -> None:
    # 3 blocks of 4 tokens: a (3-token prompt) and b (4-token prompt) take one each after the first step.
    sched = make_scheduler(block_size=4, num_blocks=3, max_model_len=12)
    a = request_factory("a", 3, max_tokens=8)
    b = request_factory("b", 4, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    runner.step()
    # a's token 3 still fits its block; b's token 4 takes the last free block.
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.finished_req_ids == set()
    assert out.scheduled_cached_reqs.new_block_ids == [[], sched.kv_cache_manager.get_block_ids("b")[1:]]
    assert sched.kv_cache_manager.get_num_free_blocks() == 0
    # a's token 4 needs a second block: none is free, so b (the last running) is preempted.
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert len(out.scheduled_cached_reqs.new_block_ids[0]) == 1
    assert sched.kv_cache_manager.get_num_free_blocks() == 1


def test_preempts_last_running_request(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                       fake_runner: Any) -> None:
    # 7 blocks of 4 tokens; three 8-token prompts take 6 blocks.
    sched = make_scheduler(block_size=4, num_blocks=7, max_model_len=28)
    a, b, c = (request_factory(n, [10 + i for i in range(8)], max_tokens=8) for n in "abc")
    for r in (a, b, c):
        sched.add_request(r)
    runner = fake_runner(sched)
    runner.step()
    assert sched.kv_cache_manager.get_num_free_blocks() == 1
    c_blocks = sched.kv_cache_manager.get_block_ids("c")
    sched.add_request(request_factory("d", 2))
    out, _ = runner.step()
    # a takes the last free block; b needs one too, so c (the last running) is preempted and b gets one of c's.
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert out.finished_req_ids == {"c"}
    assert out.scheduled_new_reqs == []  # no admission in a step that preempted
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["c", "d"]
    assert sched.kv_cache_manager.get_block_ids("b")[-1] in c_blocks
    out, _ = runner.step()
    # c needs 3 blocks to resume but only 1 is free; d waits behind it (first come, first served).
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and out.scheduled_new_reqs == []


def test_request_preempts_itself_when_last(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                           fake_runner: Any, reference_tokens: RefTokens) -> None:
    sched = make_scheduler(block_size=4, num_blocks=5, max_model_len=20)
    a = request_factory("a", 8, max_tokens=4)
    b = request_factory("b", 8, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    runner.step()
    out, outs = runner.step()
    assert out.num_scheduled_tokens == {"a": 1} and out.finished_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    b_first = list(b.output_token_ids)
    assert len(b_first) == 1
    tokens = runner.run_to_completion()
    # b resumed from scratch with its first output token recomputed, then went on as if never preempted.
    assert b_first + tokens["b"] == reference_tokens(b, 4) == b.output_token_ids
    assert a.output_token_ids == reference_tokens(a, 4)
    assert sched.kv_cache_manager.get_num_free_blocks() == 5


def test_preemption_is_invisible_in_outputs(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                            fake_runner: Any, reference_tokens: RefTokens) -> None:
    specs = [(f"r{i}", 5 + 3 * i, 6 + (5 * i) % 9) for i in range(6)]
    results = {}
    for num_blocks in (1000, 8):
        sched = make_scheduler(block_size=4, num_blocks=num_blocks, max_num_batched_tokens=16, max_model_len=32)
        reqs = [request_factory(rid, plen, max_tokens=mt) for rid, plen, mt in specs]
        for r in reqs:
            sched.add_request(r)
        runner = fake_runner(sched)
        num_preemptions = 0
        tokens: dict[str, list[int]] = {}
        while sched.has_requests():
            out, outs = runner.step()
            num_preemptions += outs.scheduler_stats.num_preemptions
            if outs.scheduler_stats.num_preemptions:
                assert out.scheduled_new_reqs == []  # no admission in a step that preempted
            assert out.total_num_scheduled_tokens <= 16
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        results[num_blocks] = (tokens, num_preemptions, sum(r.num_preemptions for r in reqs))
        assert sched.kv_cache_manager.get_num_free_blocks() == num_blocks
        assert sched.kv_cache_manager.usage == 0.0 and sched.requests == {}
        for r in reqs:
            # r5 (20-token prompt, max_tokens 13) is cut by max_model_len=32 after 12 tokens.
            assert tokens[r.request_id] == reference_tokens(r, min(r.max_tokens, 32 - r.num_prompt_tokens))
    assert results[1000][1] == 0
    assert results[8][1] > 0 and results[8][1] == results[8][2]


def test_abort_frees_blocks(make_scheduler: MakeScheduler, request_factory: MakeRequest, fake_runner: Any) -> None:
    sched = make_scheduler(max_num_seqs=1, num_blocks=40)
    a, b = request_factory("a", 9), request_factory("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    runner = fake_runner(sched)
    runner.step()
    assert sched.kv_cache_manager.get_num_free_blocks() == 37
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv_cache_manager.get_num_free_blocks() == 40
    assert sched.get_num_unfinished_requests() == 0 and not sched.has_unfinished_requests()
    assert sched.requests == {}
    # The runner held only a, so only a is dropped; both aborts are reported once.
    out = sched.schedule()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {}
    outs = sched.update_from_output(out, runner.execute(out))
    assert outs.outputs == [] and outs.finished_requests == {"a", "b"}
    assert not sched.has_requests()


def test_abort_between_schedule_and_update(make_scheduler: MakeScheduler, request_factory: MakeRequest,
                                           fake_runner: Any) -> None:
    sched = make_scheduler(num_blocks=40)
    sched.add_request(request_factory("a", 4))
    sched.add_request(request_factory("b", 4))
    runner = fake_runner(sched)
    out = sched.schedule()
    runner_output = runner.execute(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    outs = sched.update_from_output(out, runner_output)
    assert [o.request_id for o in outs.outputs] == ["b"]
    assert sched.kv_cache_manager.get_num_free_blocks() == 39
    out, _ = runner.step()
    assert out.finished_req_ids == {"a"} and out.num_scheduled_tokens == {"b": 1}
    # Aborting again, or an unknown id, changes nothing.
    sched.finish_requests(["a", "zzz"], RequestStatus.FINISHED_ABORTED)
    assert sched.get_num_unfinished_requests() == 1


def test_kv_cache_must_hold_one_full_length_request(make_scheduler: MakeScheduler) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        make_scheduler(block_size=4, num_blocks=7, max_model_len=29)
    assert make_scheduler(block_size=4, num_blocks=7, max_model_len=28).kv_cache_manager.num_blocks == 7
