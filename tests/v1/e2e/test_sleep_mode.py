"""Sleep mode on the bundled model, engine core in process (docs/rl.md, "Sleep mode"): on CPU the regions'
storage is really freed (0 bytes) and re-allocated in place. References: the same engine's outputs before it
slept (greedy and seeded sampling, token for token and mask for mask), a fresh engine on the checkpoint loaded
while asleep, and the same requests run without any sleep."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from rl_checkpoints import perturbed_weights, write_checkpoint

from vllm import LLM, SamplingParams
from vllm.outputs import RequestOutput

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 300, 12]}, {"prompt_token_ids": list(range(40, 90))}]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_sampling_mask=False)
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
ENGINE: dict[str, Any] = dict(device="cpu", max_num_seqs=8, max_model_len=256, return_sampling_mask=True,
                              logprobs_mode="processed_logprobs")


def _outputs(llm: LLM) -> list[tuple[list[int], list[list[int]] | None]]:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    return ([(o.outputs[0].token_ids, None) for o in greedy]
            + [(o.outputs[0].token_ids, o.outputs[0].sampling_mask.token_ids) for o in seeded])


def _sleeper(llm: LLM) -> Any:
    return llm.llm_engine.engine_core.engine_core.worker.sleeper


def _resident(llm: LLM) -> dict[str, int]:
    sleeper = _sleeper(llm)
    return {"weights": sleeper.weights.flat.untyped_storage().nbytes(),
            "kv_cache": sleeper.kv_cache.flat.untyped_storage().nbytes()}


def _drain(llm: LLM) -> list[RequestOutput]:
    outputs = []
    while llm.llm_engine.has_unfinished_requests():
        outputs += llm.llm_engine.step()
    return outputs


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "new", perturbed_weights(), shards=2)


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async_sched"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(enable_sleep_mode=True, async_scheduling=request.param, weight_transfer_config={"backend": "disk"},
               **ENGINE)


@pytest.fixture(scope="module")
def before(llm: LLM) -> list:
    return _outputs(llm)


def test_sleep_level_1_frees_both_regions_and_wakes_to_the_same_outputs(llm: LLM, before: list) -> None:
    held = _resident(llm)
    assert held["weights"] > 0 and held["kv_cache"] > 0
    # The long prompt's full blocks are in the prefix cache (the `before` run computed them) ...
    assert llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0
    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert _resident(llm) == {"weights": 0, "kv_cache": 0}
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.sleep(level=1)  # twice: harmless
    llm.wake_up(tags=["weights"])  # one tag at a time: still asleep, nothing scheduled
    assert llm.is_sleeping() and _resident(llm) == {"weights": held["weights"], "kv_cache": 0}
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["weights"])  # twice: harmless
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping() and _resident(llm) == held
    llm.wake_up()  # awake already: harmless
    # ... and no longer after the wake: the KV cache came back zeroed, so the cache forgot every block.
    assert llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert _outputs(llm) == before


def test_host_backup_is_made_at_start_up_and_sleep_allocates_none(llm: LLM, before: list,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' host backup exists once the engine is up (before any sleep), as large as the weights; a sleep
    and a wake allocate no host buffer of that size (the old code allocated one per level-1 sleep) and leave the
    backup where it was; it holds a byte-for-byte copy of the awake weights, which the wake restores."""
    sleeper = _sleeper(llm)
    backup = sleeper.host_backup
    assert backup.device.type == "cpu" and backup.dtype == torch.uint8
    assert backup.numel() == sleeper.weight_bytes > 0 and sleeper.host_holds is None
    ptr = backup.data_ptr()
    weights = sleeper.weights.flat.clone()  # the reference: a copy of the awake weights
    large: list[tuple[int, ...]] = []
    real_empty = torch.empty

    def counting_empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        t = real_empty(*args, **kwargs)
        if t.numel() * t.element_size() >= sleeper.weight_bytes // 2:
            large.append(tuple(t.shape))
        return t

    monkeypatch.setattr(torch, "empty", counting_empty)
    for _ in range(2):
        llm.sleep(level=1)
        assert sleeper.host_holds == "weights" and sleeper.host_backup.data_ptr() == ptr
        assert _resident(llm)["weights"] == 0
        assert torch.equal(sleeper.host_backup, weights)
        llm.wake_up()
        assert sleeper.host_holds is None and torch.equal(sleeper.weights.flat, weights)
    # Level 2: only the model's buffers (rotary tables) are kept, at their offsets in the backup.
    sleeper.host_backup.fill_(0)
    llm.sleep(level=2)
    assert sleeper.host_holds == "buffers" and sleeper.host_backup.data_ptr() == ptr
    spans = sleeper._buffer_spans
    assert spans and all(torch.equal(sleeper.host_backup[o:o + n], weights[o:o + n]) for o, n in spans)
    llm.wake_up(tags=["weights"])
    assert all(torch.equal(sleeper.weights.flat[o:o + n], weights[o:o + n]) for o, n in spans)
    sleeper.weights.flat.copy_(weights)  # stands in for the weight update a level-2 wake expects
    llm.wake_up(tags=["kv_cache"])
    monkeypatch.undo()
    assert large == []
    assert _outputs(llm) == before


def test_sleep_level_2_update_from_disk_then_kv_cache_equals_a_fresh_engine(llm: LLM, before: list,
                                                                            new_checkpoint: Path) -> None:
    llm.sleep(level=2)
    with pytest.raises(ValueError, match="weights are asleep"):
        llm.start_weight_update()
        llm.update_weights({"path": str(new_checkpoint)})
    llm.finish_weight_update()
    llm.wake_up(tags=["weights"])
    llm.start_weight_update(is_checkpoint_format=True)
    llm.update_weights({"path": str(new_checkpoint)})
    llm.finish_weight_update("step-1")
    assert llm.is_sleeping()  # the KV cache still sleeps
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    expected = _outputs(LLM(str(new_checkpoint), **ENGINE))
    assert _outputs(llm) == expected
    # Back to the bundled weights through a level-1 sleep deepened to level 2 (the host copy dropped).
    llm.sleep(level=1)
    llm.sleep(level=2)
    assert _sleeper(llm).host_holds == "buffers"  # the weights dropped, the buffers kept
    llm.wake_up()
    from vllm.config.model import default_model_path
    llm.start_weight_update()
    llm.update_weights({"path": default_model_path()})
    llm.finish_weight_update(None)
    assert _outputs(llm) == before


def test_sleep_modes_for_requests_in_the_engine(llm: LLM, before: list) -> None:
    engine = llm.llm_engine
    reference = before[0][0]
    # abort (default): the request ends now with what it had.
    engine.add_request("a", PROMPTS[0], GREEDY)
    outputs = [o for _ in range(3) for o in engine.step()]
    llm.sleep(level=1)
    outputs += _drain(llm)
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].finish_reason == "abort"
    assert final[0].outputs[0].token_ids == reference[:len(final[0].outputs[0].token_ids)]
    llm.wake_up()
    # keep: preempted, recomputed after the wake, finishes with the tokens of an uninterrupted run.
    engine.add_request("k", PROMPTS[0], GREEDY)
    outputs = [o for _ in range(3) for o in engine.step()]
    llm.sleep(level=1, mode="keep")
    assert _resident(llm)["kv_cache"] == 0
    outputs += engine.step()  # what the drained steps produced
    assert engine.step() == [] and engine.step() == []  # then nothing moves while asleep
    llm.wake_up()
    outputs += _drain(llm)
    final = [o for o in outputs if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == reference
    # wait: the call returns once the request finished (its outputs come next).
    engine.add_request("w", PROMPTS[0], GREEDY)
    engine.step()
    llm.sleep(level=1, mode="wait")
    assert llm.is_sleeping()
    final = [o for o in _drain(llm) if o.finished]
    assert len(final) == 1 and final[0].outputs[0].token_ids == reference
    # A request added while asleep ends at once, finish_reason "abort", with no token.
    engine.add_request("late", PROMPTS[0], GREEDY)
    final = [o for o in _drain(llm) if o.finished]
    assert [(o.request_id, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in final] == [
        ("late", "abort", [])]
    llm.wake_up()
    assert _outputs(llm) == before


def test_collective_rpc_sleep_and_wake_up_are_the_engines(llm: LLM, before: list) -> None:
    """verl's hybrid engine: collective_rpc("sleep", kwargs={"level": 2}) and the worker's wake_up by name."""
    assert llm.collective_rpc("sleep", kwargs={"level": 1}) == [None]
    assert llm.is_sleeping() and _resident(llm) == {"weights": 0, "kv_cache": 0}
    assert llm.collective_rpc("wake_up", kwargs={"tags": ["weights"]}) == [None]
    assert llm.is_sleeping()
    assert llm.collective_rpc("wake_up", args=(["kv_cache"],)) == [None]
    assert not llm.is_sleeping()
    with pytest.raises(ValueError, match="bad arguments for 'sleep'"):
        llm.collective_rpc("sleep", kwargs={"depth": 1})
    assert _outputs(llm) == before


def test_bad_sleep_calls_are_refused_and_change_nothing(llm: LLM, before: list) -> None:
    with pytest.raises(ValueError, match="Sleep level must be one of"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="Unknown sleep mode 'later'"):
        llm.sleep(level=1, mode="later")
    with pytest.raises(ValueError, match="Unknown wake_up tag"):
        llm.wake_up(tags=["graphs"])
    with pytest.raises(ValueError, match="list of tag names"):
        llm.wake_up(tags="weights")  # type: ignore[arg-type]
    assert not llm.is_sleeping()
    assert _outputs(llm) == before


def test_level_0_needs_no_sleep_mode_and_levels_1_2_do() -> None:
    llm = LLM(**ENGINE)
    with pytest.raises(ValueError, match="Sleep mode is off"):
        llm.sleep(level=1)
    assert not llm.is_sleeping()
    llm.sleep(level=0)  # scheduling stops, no memory moves
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up(tags=["scheduling"])
    assert not llm.is_sleeping()
    assert llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
