"""The RL lifecycle's pause / resume, collective_rpc and weight versions on the bundled model (engine core in
process, with and without async scheduling; docs/rl.md). The reference for every generation is the same
request run without any pause, on an engine of the same weights."""

from __future__ import annotations

import pytest

from vllm import LLM, SamplingParams
from vllm.outputs import RequestOutput

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 17, 42, 9, 300, 12]}


def _llm(async_scheduling: bool, **kwargs: object) -> LLM:
    return LLM(device="cpu", max_num_seqs=8, max_model_len=256, async_scheduling=async_scheduling, **kwargs)


def _drain(llm: LLM) -> list[RequestOutput]:
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += llm.llm_engine.step()
    return outputs


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_sched"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return _llm(request.param)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[int]:
    return llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_keep_mode_request_resumes_with_both_weight_versions(llm: LLM, reference: list[int]) -> None:
    engine = llm.llm_engine
    engine.add_request("keep", PROMPT, GREEDY)
    outputs = [o for _ in range(4) for o in engine.step()]
    engine.pause_generation(mode="keep", clear_cache=False)
    assert engine.is_paused()
    # Drained: whatever the steps in flight produced is handed out; then nothing moves while paused.
    outputs += engine.step() + engine.step()
    assert engine.step() == [] and engine.step() == []
    with pytest.raises(ValueError, match="paused"):
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
    engine.update_weight_version("v2")  # the same weights under a new name: the tokens must not change
    engine.resume_generation()
    assert not engine.is_paused()
    outputs += _drain(llm)
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == reference
    spans = final[0].outputs[0].weight_versions
    assert len(spans) == 2 and spans[0][0] is None and spans[1][0] == "v2"
    assert spans[0][1] == 0 and spans[0][2] == spans[1][1] and spans[1][2] == len(reference)
    assert 0 < spans[0][2] < len(reference)
    engine.update_weight_version(None)


def test_abort_mode_ends_every_request_with_its_partial_output(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", {"prompt_token_ids": [7] * 40}, GREEDY)
    outputs = [o for _ in range(3) for o in engine.step()]
    engine.pause_generation(mode="abort")
    outputs += _drain(llm)
    final = {o.request_id: o for o in outputs if o.finished}
    assert set(final) == {"a", "b"}
    for output in final.values():
        assert output.outputs[0].finish_reason == "abort"
        assert len(output.outputs[0].token_ids) < GREEDY.max_tokens
    # A request added while paused waits, then runs whole after resume.
    engine.add_request("late", PROMPT, GREEDY)
    assert engine.step() == []
    engine.resume_generation()
    late = [o for o in _drain(llm) if o.finished]
    assert late[0].request_id == "late" and late[0].outputs[0].finish_reason == "length"


def test_wait_mode_finishes_running_requests_and_holds_new_ones(llm: LLM, reference: list[int]) -> None:
    engine = llm.llm_engine
    engine.add_request("running", PROMPT, GREEDY)
    engine.step()
    engine.pause_generation(mode="wait")  # returns once "running" has finished
    engine.add_request("held", PROMPT, GREEDY)
    # NOTE: a bounded loop: "held" keeps the engine unfinished until resume.
    outputs = [o for _ in range(2 * GREEDY.max_tokens) for o in engine.step()]
    finished = [o for o in outputs if o.finished]
    assert [o.request_id for o in finished] == ["running"]
    assert finished[0].outputs[0].token_ids == reference
    assert engine.step() == []  # "held" does not run while paused
    engine.resume_generation()
    held = [o for o in _drain(llm) if o.finished]
    assert held[0].request_id == "held" and held[0].outputs[0].token_ids == reference


def test_bad_lifecycle_calls_are_refused_and_change_nothing(llm: LLM, reference: list[int]) -> None:
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="not paused"):
        engine.resume_generation()
    with pytest.raises(ValueError, match="Unknown pause mode 'later'"):
        engine.pause_generation(mode="later")
    assert not engine.is_paused()
    with pytest.raises(ValueError, match="start_weight_update first"):
        llm.update_weights({"path": "/nonexistent"})
    with pytest.raises(ValueError, match="start_weight_update first"):
        llm.finish_weight_update("v9")
    llm.start_weight_update()
    with pytest.raises(ValueError, match="already in progress"):
        llm.start_weight_update()
    llm.finish_weight_update()
    assert llm.get_weight_version() is None
    with pytest.raises(ValueError, match="Sleep mode is off"):
        llm.sleep(level=1)
    assert not llm.is_sleeping()
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference


def test_collective_rpc_reaches_the_worker_and_its_extension() -> None:
    llm = _llm(False, worker_extension_cls="rl_worker_ext.ProbeExtension")
    report = llm.collective_rpc("probe_report")
    assert report == [{"device": "cpu", "rank": 0, "local_rank": 0, "dtype": "torch.float32", "num_params": 14}]
    assert llm.collective_rpc(lambda worker, x: (worker.rank, x), args=(5,)) == [(0, 5)]
    before = llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    # The frameworks' own load path: a weight changed through model.load_weights changes the outputs.
    name = "model.layers.0.mlp.down_proj.weight"
    assert llm.collective_rpc("probe_load", args=(name, 0.0)) == [0.0]
    assert llm.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids != before
    with pytest.raises(ValueError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match="no method '_drain'"):
        llm.collective_rpc("_drain")


def test_worker_extension_errors_name_the_class() -> None:
    with pytest.raises(ValueError, match="cannot be imported"):
        _llm(False, worker_extension_cls="no_such_module.Ext")
    with pytest.raises(ValueError, match="not a class"):
        _llm(False, worker_extension_cls="rl_worker_ext.Nope")
    with pytest.raises(ValueError, match="defines update_weights, which the worker already has"):
        _llm(False, worker_extension_cls="rl_worker_ext.ClashingExtension")
