"""Parallel sampling (n > 1): child ids and seeds, aggregation per output kind, masks per child, aborts.

References: the child rule is vLLM's (id f"{i}_{parent}", n=1, seed + i); the reference output of child i is the
same prompt sent alone as an n=1 request with the child's seed; a DELTA stream is checked against the
FINAL_ONLY result of the same seeded request; aggregation is checked on fake engine-core outputs by hand.
"""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.parallel_sampling import ParentRequest

PROMPT = "The function"
TOP_K = 20


def core_request(req_id: str, **kwargs: object) -> EngineCoreRequest:
    params = SamplingParams(detokenize=False, **kwargs)  # type: ignore[arg-type]
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=[5, 6], sampling_params=params, eos_token_id=None)


class ListQueue:
    def __init__(self) -> None:
        self.items: list[RequestOutput] = []

    def put_nowait(self, item: RequestOutput) -> None:
        self.items.append(item)


# ---------------------------------------------------------------- fan-out and aggregation (no model)


@pytest.mark.parametrize("seed", [None, 0, 41])
def test_child_requests_follow_vllm_rule(seed: int | None) -> None:
    parent = core_request("req", n=3, seed=seed, temperature=1.0, max_tokens=4)
    children = ParentRequest(parent, None).make_child_requests()
    assert [c.request_id for c in children] == ["0_req", "1_req", "2_req"]
    assert [c.sampling_params.n for c in children] == [1, 1, 1]
    assert [c.sampling_params.seed for c in children] == ([None] * 3 if seed is None else [seed, seed + 1, seed + 2])
    assert all(c.prompt_token_ids == [5, 6] and c.sampling_params.max_tokens == 4 for c in children)
    assert parent.sampling_params.n == 3 and parent.sampling_params.seed == seed


def test_n_validation() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n must be"):
            SamplingParams(n=bad)  # type: ignore[arg-type]
    assert SamplingParams(n=5).n == 5


def test_delta_aggregates_children_with_new_tokens() -> None:
    proc = OutputProcessor(None, log_stats=False)
    sent = proc.add_request(core_request("p", n=3, output_kind=RequestOutputKind.DELTA), None)
    assert [r.request_id for r in sent] == ["0_p", "1_p", "2_p"]
    assert proc.get_num_unfinished_requests() == 1

    step1 = proc.process_outputs([EngineCoreOutput("2_p", [7]), EngineCoreOutput("0_p", [8])]).request_outputs
    assert len(step1) == 1 and step1[0].request_id == "p" and not step1[0].finished
    assert [(c.index, c.token_ids) for c in step1[0].outputs] == [(0, [8]), (2, [7])]

    step2 = proc.process_outputs([EngineCoreOutput("1_p", [9], finish_reason=FinishReason.LENGTH),
                                  EngineCoreOutput("0_p", [10], finish_reason=FinishReason.STOP)]).request_outputs
    assert [(c.index, c.token_ids, c.finish_reason) for c in step2[0].outputs] == [(0, [10], "stop"),
                                                                                  (1, [9], "length")]
    assert not step2[0].finished
    # A late output for a finished child is ignored.
    assert proc.process_outputs([EngineCoreOutput("0_p", [11])]).request_outputs == []

    step3 = proc.process_outputs([EngineCoreOutput("2_p", [12], finish_reason=FinishReason.LENGTH)]).request_outputs
    assert step3[0].finished and [(c.index, c.token_ids) for c in step3[0].outputs] == [(2, [12])]
    assert not proc.has_unfinished_requests() and not proc.parent_requests


def test_final_only_waits_for_all_children_and_sorts() -> None:
    proc = OutputProcessor(None, log_stats=False)
    list(proc.add_request(core_request("f", n=2, output_kind=RequestOutputKind.FINAL_ONLY), None))
    assert proc.process_outputs([EngineCoreOutput("1_f", [3], finish_reason=FinishReason.LENGTH),
                                 EngineCoreOutput("0_f", [4])]).request_outputs == []
    outs = proc.process_outputs([EngineCoreOutput("0_f", [5], finish_reason=FinishReason.STOP)]).request_outputs
    assert len(outs) == 1 and outs[0].finished
    assert [(c.index, c.token_ids) for c in outs[0].outputs] == [(0, [4, 5]), (1, [3])]


def test_cumulative_and_abort_through_queue() -> None:
    proc = OutputProcessor(None, log_stats=False)
    queue = ListQueue()
    list(proc.add_request(core_request("c", n=2, output_kind=RequestOutputKind.CUMULATIVE), None, queue))
    proc.process_outputs([EngineCoreOutput("0_c", [1]), EngineCoreOutput("1_c", [2])])
    proc.process_outputs([EngineCoreOutput("1_c", [3], finish_reason=FinishReason.LENGTH)])
    assert [[(c.index, c.token_ids) for c in o.outputs] for o in queue.items] == [[(0, [1]), (1, [2])],
                                                                                  [(1, [2, 3])]]
    assert proc.abort_requests(["c"]) == ["0_c"]
    last = queue.items[-1]
    assert last.finished and [(c.index, c.token_ids, c.finish_reason) for c in last.outputs] == [(0, [1], "abort")]
    assert not proc.request_states and not proc.parent_requests
    list(proc.add_request(core_request("d", n=2), None))
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(core_request("d", n=2), None)


@pytest.mark.parametrize("kind", [RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA])
def test_children_registered_as_sent_and_abort_mid_fan_out(kind: RequestOutputKind) -> None:
    # AsyncLLM yields to the event loop between slices of a large fan-out: a child exists only once it is made,
    # and an abort in between ends the parent with the children made so far (the rest never ran).
    proc = OutputProcessor(None, log_stats=False)
    queue = ListQueue()
    children = proc.add_request(core_request("m", n=5, seed=7, output_kind=kind), None, queue)
    first = [next(children), next(children)]
    assert [c.request_id for c in first] == ["0_m", "1_m"] and set(proc.request_states) == {"0_m", "1_m"}
    assert [c.sampling_params.seed for c in first] == [7, 8] and {c.sampling_params.n for c in first} == {1}
    proc.process_outputs([EngineCoreOutput("1_m", [4])])
    assert sorted(proc.abort_requests(["m"])) == ["0_m", "1_m"]
    assert list(children) == []  # nothing more is made after the abort
    assert not proc.request_states and not proc.parent_requests
    last = queue.items[-1]
    assert last.finished and {c.finish_reason for c in last.outputs} == {"abort"}
    assert sorted(c.index for c in last.outputs) == [0, 1]


def test_aborted_before_any_child_is_made_still_finishes() -> None:
    proc = OutputProcessor(None, log_stats=False)
    queue = ListQueue()
    children = proc.add_request(core_request("z", n=3, output_kind=RequestOutputKind.DELTA), None, queue)
    assert proc.abort_requests(["z"]) == []
    assert list(children) == [] and not proc.parent_requests
    assert queue.items[-1].finished and queue.items[-1].outputs == []


# ---------------------------------------------------------------- end to end with the bundled model


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, logprobs_mode="processed_logprobs",
               return_sampling_mask=True)


def sampled(seed: int | None, n: int = 1, **kwargs: object) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, top_k=TOP_K, seed=seed, max_tokens=4, ignore_eos=True,
                          **kwargs)  # type: ignore[arg-type]


def test_seeded_children_equal_single_requests_with_child_seeds(llm: LLM) -> None:
    seed = 1234
    [out] = llm.generate(PROMPT, sampled(seed, n=4, logprobs=2), use_tqdm=False)
    singles = llm.generate([PROMPT] * 4, [sampled(seed + i, logprobs=2) for i in range(4)], use_tqdm=False)

    assert out.request_id.isdigit() and out.finished and out.prompt == PROMPT
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "four seeded samples should not all coincide"
    for c, single in zip(out.outputs, singles):
        ref = single.outputs[0]
        assert out.prompt_token_ids == single.prompt_token_ids
        assert c.token_ids == ref.token_ids and c.text == ref.text
        assert c.sampling_mask is not None and ref.sampling_mask is not None
        assert c.sampling_mask.token_ids == ref.sampling_mask.token_ids
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        assert c.cumulative_logprob == pytest.approx(ref.cumulative_logprob)
        for token_id, mask in zip(c.token_ids, c.sampling_mask.token_ids):
            assert token_id in mask and mask == sorted(set(mask)) and 1 <= len(mask)
    assert not llm.llm_engine.has_unfinished_requests()


def test_greedy_n2_gives_identical_completions(llm: LLM) -> None:
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True, return_sampling_mask=False)
    [out] = llm.generate(PROMPT, greedy, use_tqdm=False)
    [single] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                   return_sampling_mask=False), use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids == single.outputs[0].token_ids
    assert all(c.sampling_mask is None for c in out.outputs)


def test_delta_stream_via_step_matches_final(llm: LLM) -> None:
    engine = llm.llm_engine
    [final] = llm.generate(PROMPT, sampled(77, n=3), use_tqdm=False)
    engine.add_request("stream", PROMPT, sampled(77, n=3, output_kind=RequestOutputKind.DELTA))
    assert engine.get_num_unfinished_requests() == 1
    tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
    masks: dict[int, list[list[int]]] = {0: [], 1: [], 2: []}
    finished_flags: list[bool] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "stream"
            assert [c.index for c in out.outputs] == sorted({c.index for c in out.outputs})
            finished_flags.append(out.finished)
            for c in out.outputs:
                assert c.sampling_mask is not None and len(c.sampling_mask) == len(c.token_ids)
                tokens[c.index] += c.token_ids
                masks[c.index] += c.sampling_mask.token_ids
    assert finished_flags[-1] and not any(finished_flags[:-1])
    for c in final.outputs:
        assert tokens[c.index] == c.token_ids
        assert c.sampling_mask is not None and masks[c.index] == c.sampling_mask.token_ids


def test_abort_parent_frees_all_children(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(n=3, temperature=1.0, top_k=TOP_K, max_tokens=50, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("to-abort", PROMPT, params)
    engine.step()
    scheduler = engine.engine_core.engine_core.scheduler
    assert {"0_to-abort", "1_to-abort", "2_to-abort"} <= set(scheduler.requests)
    engine.abort_request(["to-abort"])
    assert engine.get_num_unfinished_requests() == 0
    while engine.has_unfinished_requests():
        assert engine.step() == []
    assert not scheduler.requests
    # The engine still serves requests afterwards.
    assert len(llm.generate(PROMPT, sampled(5, n=2), use_tqdm=False)[0].outputs) == 2
