"""Async scheduling (two-deep batch queue, output placeholders, sampled ids fed on the device) must not change
any result: the same prompts give the same tokens, finish reasons, logprobs and sampling masks with it on and
off, through preemption, chunked prefill, seeds, stop conditions, CUDA-graph padding and aborts."""

from __future__ import annotations

from typing import Any

import pytest

from vllm import LLM, SamplingParams
from vllm.outputs import RequestOutput

PROMPTS = ["The function", "A module is", "In Python, a list", "Return the", "class", "import os\n",
           "The default value of", "Raises an exception", "An integer", "The string"]


def _summary(outs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason, o.outputs[0].text)
            for o in outs]


def _engine_core(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _assert_same_samples(ref: list[RequestOutput], got: list[RequestOutput], num_tokens: int) -> None:
    """Each request's tokens (num_tokens of them), sampling masks and logprobs equal the reference's."""
    for a, b in zip(ref, got, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and len(cb.token_ids) == num_tokens
        assert ca.sampling_mask.token_ids == cb.sampling_mask.token_ids
        assert [{k: v.logprob for k, v in d.items()} for d in ca.logprobs] == \
            [{k: v.logprob for k, v in d.items()} for d in cb.logprobs]


@pytest.fixture(scope="module")
def llms() -> dict[bool, LLM]:
    return {flag: LLM(device="cpu", max_num_seqs=8, max_model_len=128, async_scheduling=flag)
            for flag in (False, True)}


def test_async_flag_selects_the_batch_queue(llms: dict[bool, LLM]) -> None:
    assert not _engine_core(llms[False]).async_scheduling
    core = _engine_core(llms[True])
    assert core.async_scheduling and type(core.scheduler).__name__ == "AsyncScheduler"


def test_greedy_stops_and_lengths_match(llms: dict[bool, LLM]) -> None:
    sync = llms[False]
    free = sync.generate(PROMPTS[:4], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)
    # Stop on a token that shows up mid-way, with different max_tokens per request (10 requests > 8 seqs).
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i, ignore_eos=True,
                             stop_token_ids=[free[i % 4].outputs[0].token_ids[2]]) for i in range(10)]
    results = {flag: llm.generate(PROMPTS, params, use_tqdm=False) for flag, llm in llms.items()}
    assert _summary(results[True]) == _summary(results[False])
    for out, p in zip(results[True], params):
        ids = out.outputs[0].token_ids
        assert len(ids) <= p.max_tokens
        if out.outputs[0].finish_reason == "stop":
            assert ids[-1] in p.stop_token_ids and not set(ids[:-1]) & set(p.stop_token_ids)
    for llm in llms.values():
        core = _engine_core(llm)
        assert not core.has_unfinished_requests() and not core.batch_queue
        assert core.scheduler.kv_cache_manager.usage == 0


def test_seeded_logprobs_and_masks_match() -> None:
    """Async scheduling gives the synchronous engine's seeded tokens, logprobs and masks, with the mask lists built
    by the caller's thread when it takes the step's outputs (deferred, as the engine core always does)."""
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=100 + i, max_tokens=10, logprobs=3,
                             ignore_eos=True) for i in range(5)]
    results = {}
    for flag in (False, True):
        llm = LLM(device="cpu", max_num_seqs=4, max_model_len=128, async_scheduling=flag,
                  return_sampling_mask=True, logprobs_mode="processed_logprobs")
        # The runner hands the scheduler its per-row settings every step (else the scheduler falls back to reading
        # every request, the same routing, slower).
        scheduler, with_settings = _engine_core(llm).scheduler, []
        update = scheduler.update_from_output
        scheduler.update_from_output = lambda so, mo, f=update, seen=with_settings: (
            seen.append(mo.row_settings is not None), f(so, mo))[1]
        results[flag] = llm.generate(PROMPTS[:5], params, use_tqdm=False)
        assert with_settings and all(with_settings)
        assert _engine_core(llm).worker.model_runner.output_copier.defer_mask_lists
    _assert_same_samples(results[False], results[True], 10)
    for out in results[True]:
        for token, support in zip(out.outputs[0].token_ids, out.outputs[0].sampling_mask.token_ids):
            assert token in support and len(support) <= 20


@pytest.mark.parametrize("pad_decode,pad_mixed", [(False, False), (True, False), (True, True)])
def test_preemption_and_chunked_prefill_match(pad_decode: bool, pad_mixed: bool) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    results, preempted = {}, {}
    mixed_pads: list[int] = []
    for flag in (False, True):
        # 12 blocks of 4 tokens cannot hold 8 growing requests; 8-token steps chunk every prompt.
        llm = LLM(device="cpu", max_num_seqs=8, max_model_len=32, block_size=4, num_gpu_blocks_override=12,
                  max_num_batched_tokens=8, async_scheduling=flag)
        core = _engine_core(llm)
        runner = core.worker.model_runner
        runner.pad_eager_decode = pad_decode
        # Mixed steps are padded to 8 tokens and 9 rows (the only mixed size: the token budget).
        runner.pad_eager_mixed = pad_mixed
        prepare = runner.input_buffers.prepare
        runner.input_buffers.prepare = lambda *a, p=prepare, **k: (mixed_pads.append(a[4]), p(*a, **k))[1]
        sched, names = core.scheduler, []
        original = sched._preempt
        sched._preempt = lambda req, o=original, n=names: (n.append(req.request_id), o(req))[1]
        results[flag] = llm.generate(PROMPTS[:8], greedy, use_tqdm=False)
        preempted[flag] = names
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 12
        assert not core.batch_queue and runner.input_batch.num_reqs <= 8
    assert preempted[False] and preempted[True], "the KV budget was meant to force preemption"
    assert _summary(results[True]) == _summary(results[False])
    assert (8 in mixed_pads) == pad_mixed and set(mixed_pads) <= {None, 8}
    if pad_mixed:  # and the padded runs give the unpadded tokens
        llm = LLM(device="cpu", max_num_seqs=8, max_model_len=32, block_size=4, num_gpu_blocks_override=12,
                  max_num_batched_tokens=8, async_scheduling=False)
        assert _summary(llm.generate(PROMPTS[:8], greedy, use_tqdm=False)) == _summary(results[False])


def test_abort_mid_flight_matches() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = {}
    for flag in (False, True):
        engine = LLM(device="cpu", max_num_seqs=4, max_model_len=64, async_scheduling=flag).llm_engine
        for i in range(4):
            engine.add_request(str(i), PROMPTS[i], greedy)
        finished: dict[str, Any] = {}
        num_steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].finish_reason)
            num_steps += 1
            if num_steps == 4:
                engine.abort_request(["1"])
        core = engine.engine_core.engine_core
        assert core.scheduler.kv_cache_manager.usage == 0 and not core.scheduler.requests
        results[flag] = finished
    assert results[True] == results[False]
    assert set(results[True]) == {"0", "2", "3"} and all(len(v[0]) == 12 for v in results[True].values())


def test_next_step_launches_before_previous_tokens_reach_the_host() -> None:
    llm = LLM(device="cpu", max_num_seqs=4, max_model_len=64, async_scheduling=True)
    core = _engine_core(llm)
    runner = core.worker.model_runner
    in_flight: list[int] = []
    fed_from_device: list[int] = []
    execute = core.worker.execute_model_async

    def spy(so: Any) -> Any:
        in_flight.append(len(core.batch_queue))
        batch = runner.input_batch
        rows = [batch.req_id_to_index[r] for r in so.num_scheduled_tokens if r in batch.req_id_to_index]
        # Rows whose newest token exists only on the device when this step is launched.
        fed_from_device.append(sum(int(batch.prev_sampled_idx[r] >= 0) for r in rows))
        return execute(so)

    core.worker.execute_model_async = spy
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    ref = LLM(device="cpu", max_num_seqs=4, max_model_len=64, async_scheduling=False).generate(
        PROMPTS[:2], greedy, use_tqdm=False)
    assert _summary(outs) == _summary(ref)
    assert max(in_flight) == 1, "a step must be launched while the previous one is still in flight"
    assert sum(fed_from_device) >= 2 * 4


def test_stop_strings_with_async_scheduling() -> None:
    """A stop string found by the frontend aborts its request while the next step is in flight: texts, tokens and finish reasons equal the synchronous engine's, and every block comes back."""
    seeded = [SamplingParams(temperature=0.8, top_k=20, seed=30 + i, max_tokens=16, ignore_eos=True)
              for i in range(4)]
    llms = {}
    for ahead in (None, True):  # None: synchronous steps, the reference
        llms[ahead] = LLM(device="cpu", max_num_seqs=4, max_model_len=128, async_scheduling=ahead is not None)
    free = llms[None].generate(PROMPTS[:4], seeded, use_tqdm=False)
    # Stop strings taken from the middle of each free text, so that each request stops early.
    stops = [o.outputs[0].text[len(o.outputs[0].text) // 2:][:3] for o in free]
    assert all(stops)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=30 + i, max_tokens=16, ignore_eos=True,
                             stop=[stops[i]]) for i in range(4)]
    results = {ahead: llm.generate(PROMPTS[:4], params, use_tqdm=False) for ahead, llm in llms.items()}
    assert _summary(results[True]) == _summary(results[None])
    assert all(o.outputs[0].finish_reason == "stop" for o in results[True])
    core = _engine_core(llms[True])
    assert not core.has_unfinished_requests() and not core.batch_queue
    assert core.scheduler.kv_cache_manager.usage == 0


def test_deferred_mask_lists_with_async_scheduling() -> None:
    """With async scheduling the masks are built when the frontend takes the step's outputs (the next step in
    flight), and tokens, masks, logprobs and the stats' mask sizes (over the whole run)
    equal the synchronous engine's."""
    params = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=50 + i, max_tokens=8, logprobs=1,
                             ignore_eos=True) for i in range(5)]
    results, sizes = {}, {}
    for deferred in (False, True):  # False: synchronous steps, the reference
        llm = LLM(device="cpu", max_num_seqs=4, max_model_len=128, async_scheduling=deferred,
                  return_sampling_mask=True, logprobs_mode="processed_logprobs")
        client = llm.llm_engine.engine_core
        seen: list[int] = []
        get_output = client.get_output
        client.get_output = lambda g=get_output, s=seen: (lambda o: (s.extend(
            o.scheduler_stats.sampling_mask_sizes if o.scheduler_stats else []), o)[1])(g())
        results[deferred] = llm.generate(PROMPTS[:5], params, use_tqdm=False)
        sizes[deferred] = sorted(seen)
    assert len(sizes[True]) == 5 * 8 and sizes[True] == sizes[False]
    _assert_same_samples(results[False], results[True], 8)
