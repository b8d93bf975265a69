"""LLM.generate steps its engine under the serving GC thresholds (vllm/v1/serving_gc.py) and gives the caller
its own back afterwards, also when a step fails; nothing of the caller's heap is frozen."""

from __future__ import annotations

import gc

import pytest

from vllm import LLM, SamplingParams
from vllm.v1.serving_gc import SERVING_GC_THRESHOLDS, serving_thresholds


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=64, max_num_seqs=4)


def test_generate_steps_under_the_serving_thresholds_and_restores_the_callers(llm: LLM,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    caller = (1234, 7, 9)
    seen: list[tuple[int, int, int]] = []
    step = llm.llm_engine.step

    def recording_step():  # noqa: ANN202
        seen.append(gc.get_threshold())
        return step()

    old = gc.get_threshold()
    gc.set_threshold(*caller)
    try:
        monkeypatch.setattr(llm.llm_engine, "step", recording_step)
        frozen = gc.get_freeze_count()
        out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        assert seen and all(t == SERVING_GC_THRESHOLDS for t in seen)
        assert gc.get_threshold() == caller and gc.get_freeze_count() == frozen

        def failing_step():  # noqa: ANN202
            raise RuntimeError("step failed")

        monkeypatch.setattr(llm.llm_engine, "step", failing_step)
        with pytest.raises(RuntimeError, match="step failed"):
            llm.generate(["Hello"], SamplingParams(max_tokens=3), use_tqdm=False)
        assert gc.get_threshold() == caller
    finally:
        gc.set_threshold(*old)


def test_serving_thresholds_block() -> None:
    old = gc.get_threshold()
    with serving_thresholds():
        assert gc.get_threshold() == SERVING_GC_THRESHOLDS
    assert gc.get_threshold() == old


@pytest.mark.parametrize("caller", [(0, 10, 10), (50_000, 5, 30)])
def test_serving_thresholds_keep_what_the_caller_set(caller: tuple[int, int, int]) -> None:
    """A collector the caller turned off stays off; a caller's higher threshold is not lowered."""
    old = gc.get_threshold()
    try:
        gc.set_threshold(*caller)
        with serving_thresholds():
            got = gc.get_threshold()
        assert got == caller if caller[0] == 0 else got == (50_000, 10, 30)
        assert gc.get_threshold() == caller
    finally:
        gc.set_threshold(*old)
