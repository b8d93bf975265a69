"""Automatic prefix caching in the engine core: digests, hits, eviction order, salts, reset, invalidation.

References: the digests are recomputed here from their definition with hashlib and struct (not with the
engine's helper); hit counts and eviction orders are worked out by hand in each test; and `KVRunner` (a
FakeRunner that also keeps a model of the KV cache: which token sits in which slot) checks at every step that
every position a request attends to holds that request's own token at that position, so a wrong hit, a block
evicted while in use or a block reused before it was freed fails at once.
"""

from __future__ import annotations

import hashlib
import random
import struct
from collections.abc import Callable
from typing import Any

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_request_blocks
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

MakeScheduler = Callable[..., Scheduler]
EOS_TOKEN_ID = 2


def _request(req_id: str, prompt: list[int], cache_salt: str | None = None, **params: Any) -> Request:
    params.setdefault("max_tokens", 4)
    return Request(req_id, list(prompt), SamplingParams(**params), EOS_TOKEN_ID, cache_salt=cache_salt)


def _kv_runner_class(base: type) -> type:
    """A FakeRunner whose steps also write each computed token into a model of the KV cache (block, offset) ->
    (position, token), and check that every position a request's step attends to holds its own token."""

    def execute(self: Any, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.scheduler.block_size
        starts = {}
        for new in out.scheduled_new_reqs:
            starts[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        for req_id, num_computed in zip(cached.req_ids, cached.num_computed_tokens):
            starts[req_id] = num_computed
        result = base.execute(self, out)
        # Every layer writes the step's KV before any attention reads it: write all, then check all.
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            for pos in range(starts[req_id], starts[req_id] + num):
                self.__dict__.setdefault("kv", {})[(state.block_ids[pos // bs], pos % bs)] = (pos, state.token_ids[pos])
        for req_id, num in out.num_scheduled_tokens.items():
            state = self.states[req_id]
            for pos in range(starts[req_id] + num):
                assert self.__dict__["kv"].get((state.block_ids[pos // bs], pos % bs)) == (pos, state.token_ids[pos]), (
                    f"{req_id} attends to a wrong KV entry at position {pos}")
        self.scheduler.kv_cache_manager.check_invariants()
        return result

    return type("KVRunner", (base,), {"execute": execute})


@pytest.fixture(autouse=True)
def _runner_classes(fake_runner: type, request_factory: Callable[..., Request]) -> None:
    global KVRunner, history_token
    KVRunner = _kv_runner_class(fake_runner)
    history_token = request_factory.__globals__["history_token"]


KVRunner: Any = None
history_token: Any = None


def _digest(parent: bytes | None, tokens: list[int], salt: bytes = b"") -> bytes:
    return hashlib.sha256((ROOT_HASH if parent is None else parent) + struct.pack(f"<{len(tokens)}i", *tokens)
                          + salt).digest()


def test_block_digests_are_chained_and_salted() -> None:
    req = _request("a", list(range(10)))
    h = list(hash_request_blocks(req, 4, 10))
    assert len(h) == 2  # two full blocks of 4; the last 2 tokens are no block
    assert h[0] == _digest(None, [0, 1, 2, 3]) and h[1] == _digest(h[0], [4, 5, 6, 7])
    salted = _request("b", list(range(10)), cache_salt="policy-7")
    s = hash_request_blocks(salted, 4, 10)
    assert s[0] == _digest(None, [0, 1, 2, 3], "policy-7".encode()) and s[1] == _digest(s[0], [4, 5, 6, 7])
    assert not set(s) & set(h)  # the salt changes every later digest through the chain
    assert hash_block_tokens(None, [0, 1, 2, 3], b"policy-7") == s[0] and hash_block_tokens(h[0], [4, 5, 6, 7]) == h[1]
    # The same tokens after a different prefix are a different block.
    other = hash_request_blocks(_request("c", [9, 1, 2, 3, 4, 5, 6, 7]), 4, 2)
    assert other[1] != h[1]
    # Generated tokens extend the list; earlier digests stay.
    req.append_output_token_ids([10, 11])
    assert hash_request_blocks(req, 4, 100)[:2] == h and len(req.block_hashes) == 3


def test_free_queue_evicts_lru_and_request_tails_first() -> None:
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # [0, 1, 2]
    for i, b in enumerate(a):
        pool.cache_block(b, bytes([i]) * 32)
    b = pool.get_new_blocks(2)  # [3, 4]
    pool.free_blocks(reversed(a))  # a request frees its tail first
    pool.free_blocks(reversed(b))
    # Queue: 5 (never used), then a's blocks tail first (2, 1, 0), then b's (4, 3).
    assert list(pool.free_queue) == [5, 2, 1, 0, 4, 3]
    # A hit on a free cached block takes it out of the queue; freeing it again puts it at the back.
    pool.touch([1])
    assert list(pool.free_queue) == [5, 2, 0, 4, 3] and pool.ref_cnt[1] == 1
    pool.free_blocks([1])
    assert list(pool.free_queue) == [5, 2, 0, 4, 3, 1]
    # Allocation evicts from the front: block 2 loses its digest, 0 and 1 keep theirs.
    assert pool.get_new_blocks(2) == [5, 2]
    assert pool.get_cached_block(bytes([2]) * 32) is None
    assert pool.get_cached_block(bytes([0]) * 32) == 0 and pool.get_cached_block(bytes([1]) * 32) == 1
    pool.check_invariants([[5], [2]])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_blocks([0])


def test_hits_are_block_aligned_and_leave_the_last_token(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    runner = KVRunner(sched)
    a = _request("a", list(range(100, 110)), max_tokens=1)  # 10 tokens: blocks [100..103], [104..107]
    sched.add_request(a)
    _, outs = runner.step()
    assert (outs.scheduler_stats.prefix_cache_queries, outs.scheduler_stats.prefix_cache_hits) == (10, 0)
    runner.run_to_completion()
    # Shares 9 tokens with a: 2 full blocks (8 tokens) hit, 2 tokens computed.
    b = _request("b", list(range(100, 109)) + [7], max_tokens=1)
    # Exactly a's first 8 tokens: a hit would cover every token, so it stops one block short (4 tokens).
    c = _request("c", list(range(100, 108)), max_tokens=1)
    # Differs in the first token: no hit.
    d = _request("d", [99] + list(range(101, 110)), max_tokens=1)
    for r in (b, c, d):
        sched.add_request(r)
    out, outs = runner.step()
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"b": 8, "c": 4, "d": 0}
    assert out.num_scheduled_tokens == {"b": 2, "c": 4, "d": 10}
    assert {o.request_id: o.num_cached_tokens for o in outs.outputs} == {"b": 8, "c": 4, "d": 0}
    assert (outs.scheduler_stats.prefix_cache_queries, outs.scheduler_stats.prefix_cache_hits) == (28, 12)
    assert b.output_token_ids == [history_token("b", b.prompt_token_ids)]
    runner.run_to_completion()
    assert sched.kv_cache_manager.block_pool.num_used_blocks() == 0


def test_shared_blocks_are_reference_counted(make_scheduler: MakeScheduler) -> None:
    """n > 1 (GRPO): the children of one prompt arrive as separate requests; the later ones share the first
    one's prompt blocks (hit in the same step they are computed in), each holding a reference."""
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    runner = KVRunner(sched)
    prompt = list(range(200, 213))  # 13 tokens: 3 full blocks
    kids = [_request(f"p-{i}", prompt, max_tokens=6, temperature=1.0, seed=i) for i in range(4)]
    for k in kids:
        sched.add_request(k)
    out, _ = runner.step()
    assert out.num_scheduled_tokens == {"p-0": 13, "p-1": 1, "p-2": 1, "p-3": 1}
    tables = [sched.kv_cache_manager.get_block_ids(k.request_id) for k in kids]
    assert all(t[:3] == tables[0][:3] for t in tables) and len({t[3] for t in tables}) == 4
    pool = sched.kv_cache_manager.block_pool
    assert [pool.ref_cnt[b] for b in tables[0][:3]] == [4, 4, 4]
    sched.finish_requests(["p-1"], RequestStatus.FINISHED_ABORTED)
    assert [pool.ref_cnt[b] for b in tables[0][:3]] == [3, 3, 3]
    runner.run_to_completion()
    assert pool.num_used_blocks() == 0 and pool.ref_cnt == [0] * pool.num_blocks
    # The prompt's blocks stay cached for the next group.
    assert all(pool.block_hash[b] is not None for b in tables[0][:3])


def test_salts_never_share_blocks(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    runner = KVRunner(sched)
    prompt = list(range(300, 312))
    sched.add_request(_request("x", prompt, cache_salt="v1", max_tokens=1))
    runner.run_to_completion()
    for rid, salt, hits in (("unsalted", None, 0), ("other", "v2", 0), ("same", "v1", 8)):
        sched.add_request(_request(rid, prompt, cache_salt=salt, max_tokens=1))
        out, outs = runner.step()
        assert out.scheduled_new_reqs[0].num_computed_tokens == hits, rid
        runner.run_to_completion()


def test_prompt_logprobs_requests_get_no_hits(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    runner = KVRunner(sched)
    sched.add_request(_request("a", list(range(12)), max_tokens=1))
    runner.run_to_completion()
    sched.add_request(_request("b", list(range(12)), max_tokens=1, prompt_logprobs=0))
    out, outs = runner.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0
    assert outs.scheduler_stats.prefix_cache_queries == 0  # not a lookup


def test_eviction_keeps_the_most_recent_prefixes(make_scheduler: MakeScheduler) -> None:
    # 8 blocks of 4 tokens.
    sched = make_scheduler(block_size=4, num_blocks=8, max_model_len=32, enable_prefix_caching=True)
    runner = KVRunner(sched)
    old, new = list(range(10, 19)), list(range(50, 59))  # 9 tokens each: 2 full blocks + 1 partial
    for rid, prompt in (("old", old), ("new", new)):
        sched.add_request(_request(rid, prompt, max_tokens=1))
        runner.run_to_completion()
    pool = sched.kv_cache_manager.block_pool
    # old took blocks 0, 1, 2 and freed them tail first; new took 3, 4, 5 likewise:
    assert list(pool.free_queue) == [6, 7, 2, 1, 0, 5, 4, 3]
    # A 13-token prompt needs 4 blocks: the two never used, then old's partial block and old's second block.
    sched.add_request(_request("big", list(range(600, 613)), max_tokens=1))
    runner.run_to_completion()
    old_digests = hash_request_blocks(_request("o", old), 4, 2)
    new_digests = hash_request_blocks(_request("n", new), 4, 2)
    assert [pool.get_cached_block(h) for h in old_digests] == [0, None]
    assert [pool.get_cached_block(h) for h in new_digests] == [3, 4]
    sched.add_request(_request("new2", new + [1], max_tokens=1))
    out, _ = runner.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


def test_reset_prefix_cache_semantics(make_scheduler: MakeScheduler) -> None:
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    runner = KVRunner(sched)
    prompt = list(range(400, 412))
    a = _request("a", prompt, max_tokens=3)
    sched.add_request(a)
    runner.step()
    assert sched.reset_prefix_cache() is False  # a holds blocks: nothing changes
    assert sched.kv_cache_manager.block_pool.cached_blocks
    assert sched.reset_prefix_cache(reset_running_requests=True) is True
    assert a.status == RequestStatus.PREEMPTED and list(sched.waiting) == [a] and sched.running == []
    assert not sched.kv_cache_manager.block_pool.cached_blocks
    out, _ = runner.step()  # a resumes from scratch: nothing is cached any more
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0 and out.finished_req_ids == {"a"}
    tokens = runner.run_to_completion()
    expected = list(prompt)
    for _ in range(3):
        expected.append(history_token("a", expected))
    assert a.output_token_ids == expected[12:] and tokens["a"] == expected[14:]  # as if never preempted
    assert sched.reset_prefix_cache() is True
    sched.add_request(_request("b", prompt, max_tokens=1))
    out, _ = runner.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_invalidation_hides_old_blocks_and_stops_old_requests_from_caching(make_scheduler: MakeScheduler) -> None:
    """A weight update: KV computed with the old weights, or on top of it, is never found again."""
    sched = make_scheduler(block_size=4, enable_prefix_caching=True)
    runner = KVRunner(sched)
    prompt = list(range(500, 510))
    sched.add_request(_request("done", prompt, max_tokens=1))
    runner.run_to_completion()
    running = _request("running", list(range(700, 706)), max_tokens=12)
    sched.add_request(running)
    runner.step()
    sched.kv_cache_manager.invalidate_prefix_cache()
    runner.run_to_completion()  # it fills more blocks after the update, on top of old KV
    assert not sched.kv_cache_manager.block_pool.cached_blocks
    sched.add_request(_request("again", prompt, max_tokens=1))
    sched.add_request(_request("cont", running.all_token_ids[:16], max_tokens=1))
    out, _ = runner.step()
    assert {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs} == {"again": 0, "cont": 0}
    runner.run_to_completion()
    sched.add_request(_request("again2", prompt, max_tokens=1))  # computed after the update: cached again
    out, _ = runner.step()
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workload_matches_no_cache(make_scheduler: MakeScheduler, seed: int) -> None:
    """Prompts sharing prefixes of every length around block boundaries, salts, aborts and preemptions forced by
    a small KV budget: every request's tokens equal the run without the cache, the KV model checks every step,
    and the pool ends with no block in use and consistent indexes."""
    rng = random.Random(seed)
    bases = [[rng.randrange(3, 999) for _ in range(30)] for _ in range(3)]
    specs = []
    for i in range(40):
        base = rng.choice(bases)
        cut = rng.choice([1, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17])
        prompt = base[:cut] + [rng.randrange(3, 999) for _ in range(rng.randrange(0, 6))]
        salt = rng.choice([None, None, "a", "b"])
        specs.append((f"r{i}", prompt, salt, rng.randrange(1, 9), rng.random() < 0.15))
    results = {}
    for caching in (False, True):
        sched = make_scheduler(block_size=4, num_blocks=14, max_model_len=48, max_num_batched_tokens=24,
                               max_num_seqs=6, enable_prefix_caching=caching)
        runner = KVRunner(sched)
        tokens: dict[str, list[int]] = {}
        pending = list(specs)
        aborts = []
        num_hits = num_preemptions = 0
        while pending or sched.has_requests():
            for _ in range(rng.randrange(0, 4)):
                if pending:
                    rid, prompt, salt, max_tokens, abort = pending.pop(0)
                    sched.add_request(_request(rid, prompt, cache_salt=salt, max_tokens=max_tokens))
                    if abort:
                        aborts.append(rid)
            out, outs = runner.step()
            num_hits += outs.scheduler_stats.prefix_cache_hits
            num_preemptions += outs.scheduler_stats.num_preemptions
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if aborts and rng.random() < 0.3:
                sched.finish_requests([aborts.pop(0)], RequestStatus.FINISHED_ABORTED)
        results[caching] = (tokens, num_hits)
        assert num_preemptions > 0  # the small KV budget forces them
        assert sched.kv_cache_manager.block_pool.num_used_blocks() == 0
        sched.kv_cache_manager.check_invariants()
    # Aborts land at the same steps in both runs only by chance, so compare the requests never aborted.
    never_aborted = {rid for rid, *_, abort in specs if not abort}
    assert {r: t for r, t in results[True][0].items() if r in never_aborted} == \
        {r: t for r, t in results[False][0].items() if r in never_aborted}
    assert results[True][1] > 0 and results[False][1] == 0
