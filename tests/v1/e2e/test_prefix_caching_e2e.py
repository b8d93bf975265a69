"""Prefix caching end to end on CPU (the bundled tiny model): outputs with the cache equal outputs without it.

The reference is the same engine with `enable_prefix_caching=False`: every prompt computed in full. Prompts
share prefixes of every length around the block boundaries (block_size 4), requests of one prompt come as n > 1
children, the KV budget is small enough to force preemptions, and salts must keep blocks apart. Checked:
greedy tokens, seeded sampling tokens and their sampling masks, token for token; that the cache was used (hits
counted, `num_cached_tokens`, fewer tokens computed); that no block is left in use and the pool's invariants
hold; reset and weight-update semantics.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler

BLOCK = 4


def _prompts(seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    base = [rng.randrange(10, 500) for _ in range(24)]
    prompts = []
    for cut in (1, 3, 4, 5, 7, 8, 9, 11, 12, 13, 16, 17):
        prompts.append({"prompt_token_ids": base[:cut] + [rng.randrange(10, 500) for _ in range(rng.randrange(3))]})
    prompts.append({"prompt_token_ids": list(base[:12])})  # an exact repeat: hits stop one block short
    prompts.append({"prompt_token_ids": list(base[:12]), "cache_salt": "other"})
    return prompts


def _llm(caching: bool, **kwargs: Any) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 24)  # 96 tokens for up to 8 requests of ~30: preemptions
    return LLM(device="cpu", skip_tokenizer_init=True, max_num_seqs=8, max_model_len=64, block_size=BLOCK,
               max_num_batched_tokens=32, enable_prefix_caching=caching, **kwargs)


def _scheduler(llm: LLM) -> Scheduler:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _run(llm: LLM, prompts: list[dict[str, Any]], params: list[SamplingParams]) -> tuple[list[Any], dict[str, int]]:
    sched = _scheduler(llm)
    counts = {"computed": 0, "preemptions": 0, "hits": 0}
    schedule, make_stats = sched.schedule, sched.make_stats

    def counting_schedule() -> Any:
        out = schedule()
        counts["computed"] += out.total_num_scheduled_tokens
        return out

    def counting_stats(*args: Any) -> Any:
        stats = make_stats(*args)
        counts["preemptions"] += stats.num_preemptions
        counts["hits"] += stats.prefix_cache_hits
        return stats

    sched.schedule, sched.make_stats = counting_schedule, counting_stats  # type: ignore[method-assign]
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del sched.schedule, sched.make_stats
    assert sched.kv_cache_manager.block_pool.num_used_blocks() == 0
    sched.kv_cache_manager.check_invariants()
    return outs, counts


def _tokens(outs: list[Any]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_and_n_children_equal_without_cache(async_scheduling: bool) -> None:
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=1 + i % 3)
              for i in range(len(prompts))]
    results = {}
    for caching in (False, True):
        results[caching] = _run(_llm(caching, async_scheduling=async_scheduling), prompts, params)
    (ref, ref_counts), (got, counts) = results[False], results[True]
    assert _tokens(got) == _tokens(ref)
    assert ref_counts["hits"] == 0 and counts["hits"] > 0
    assert counts["computed"] < ref_counts["computed"]
    assert counts["preemptions"] > 0 and ref_counts["preemptions"] > 0  # the small budget forces them
    # The exact repeat of an earlier prompt: 12 tokens, hits stop one block short (8); the salted copy: none
    # unless its own n > 1 siblings (a later child) found its blocks.
    assert got[-2].num_cached_tokens == 8
    assert all(o.num_cached_tokens in (0, None) for o in ref)


def test_seeded_sampling_and_masks_equal_without_cache() -> None:
    prompts = _prompts(1)
    params = [SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=100 + i, max_tokens=8, ignore_eos=True,
                             n=2 if i % 2 else 1) for i in range(len(prompts))]
    results = {}
    for caching in (False, True):
        llm = _llm(caching, return_sampling_mask=True, logprobs_mode="processed_logprobs")
        outs, counts = _run(llm, prompts, params)
        results[caching] = (outs, counts)
    ref, got = results[False][0], results[True][0]
    assert results[True][1]["hits"] > 0
    assert _tokens(got) == _tokens(ref)
    for r, g in zip(ref, got):
        for rc, gc in zip(sorted(r.outputs, key=lambda c: c.index), sorted(g.outputs, key=lambda c: c.index)):
            assert gc.sampling_mask.token_ids == rc.sampling_mask.token_ids


def test_aborts_release_blocks() -> None:
    llm = _llm(True, num_gpu_blocks_override=64)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(30, 50))}
    for i in range(6):
        engine.add_request(f"r{i}", prompt, greedy)
    for _ in range(3):
        engine.step()
    engine.abort_request(["r1", "r4"])
    while engine.has_unfinished_requests():
        engine.step()
    sched = _scheduler(llm)
    assert sched.kv_cache_manager.block_pool.num_used_blocks() == 0
    sched.kv_cache_manager.check_invariants()


def test_salts_and_num_cached_tokens() -> None:
    llm = _llm(True, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ids = list(range(60, 78))  # 18 tokens: 4 full blocks
    first = llm.generate({"prompt_token_ids": ids, "cache_salt": "policy-1"}, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    cached = {salt: llm.generate({"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}, greedy,
                                 use_tqdm=False)[0] for salt in ("policy-1", "policy-2", None)}
    assert {k: v.num_cached_tokens for k, v in cached.items()} == {"policy-1": 16, "policy-2": 0, None: 0}
    assert all(v.outputs[0].token_ids == first.outputs[0].token_ids for v in cached.values())
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": ""}, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate({"prompt_token_ids": ids, "cache_salt": 7}, greedy, use_tqdm=False)  # type: ignore[typeddict-item]


def test_reset_prefix_cache_and_weight_updates() -> None:
    llm = _llm(True, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(80, 97))}
    ref = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 16
    assert llm.reset_prefix_cache() is True  # nothing running
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 0
    # While a request holds blocks: False, unless reset_running_requests (it is preempted and recomputed).
    engine = llm.llm_engine
    engine.add_request("held", prompt, greedy)
    engine.step()
    assert engine.reset_prefix_cache() is False
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == ref
    # A weight update (even of no tensor) invalidates every cached block.
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 16
    llm.start_weight_update()
    llm.finish_weight_update("v2")
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 0


def test_off_by_flag() -> None:
    llm = _llm(False, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = {"prompt_token_ids": list(range(80, 97))}
    llm.generate(prompt, greedy, use_tqdm=False)
    assert llm.generate(prompt, greedy, use_tqdm=False)[0].num_cached_tokens == 0
    assert not _scheduler(llm).kv_cache_manager.block_pool.cached_blocks
    assert _llm(True).llm_engine.vllm_config.cache_config.enable_prefix_caching is True
    assert LLM(device="cpu", skip_tokenizer_init=True, max_model_len=64,
               num_gpu_blocks_override=16).llm_engine.vllm_config.cache_config.enable_prefix_caching is True


@pytest.mark.parametrize("clear_cache", [True, False])
def test_keep_pause_with_clear_cache_preempts_as_vllm(clear_cache: bool) -> None:
    """vLLM's pause_scheduler(clear_cache=True) resets the cache with reset_running_requests: the kept request is
    preempted (recomputed after resume, same tokens); clear_cache=False keeps its blocks."""
    llm = _llm(True, num_gpu_blocks_override=64)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(120, 137))}
    ref = llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine, sched = llm.llm_engine, _scheduler(llm)
    engine.add_request("kept", prompt, greedy)
    outs = engine.step() + engine.step()
    engine.pause_generation(mode="keep", clear_cache=clear_cache)
    request = sched.requests["kept"]
    assert (request.num_preemptions == 1) is clear_cache
    assert bool(sched.kv_cache_manager.block_pool.cached_blocks) is not clear_cache
    engine.resume_generation()
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    assert [o for o in outs if o.finished][0].outputs[0].token_ids == ref
