"""weight_sync.run_weight_change judges the ranks' outcomes of a weight change together (hand-worked cases): all
succeeded -> nothing raised; all refused (ValueError: no rank changed) -> the lowest rank's refusal, the engine
serves on; any other mix with several ranks -> WeightsOutOfStepError (fatal, an EngineStepError); one rank -> its
own error as it is."""

from __future__ import annotations

from typing import Any

import pytest

from vllm.v1.engine import EngineStepError
from vllm.v1.engine.weight_sync import WeightsOutOfStepError, run_weight_change


class FakeExecutor:
    def __init__(self, outcomes: list[tuple[bool, Any]]) -> None:
        self.outcomes = outcomes
        self.calls: list[tuple[str, tuple]] = []

    def run_workers_outcomes(self, method: str, *args: Any) -> list[tuple[bool, Any]]:
        self.calls.append((method, args))
        return self.outcomes


def _run(outcomes: list[tuple[bool, Any]]) -> None:
    executor = FakeExecutor(outcomes)
    run_weight_change(executor, "load_weights_from_disk", "/ckpt")  # type: ignore[arg-type]
    assert executor.calls == [("load_weights_from_disk", ("/ckpt",))]


def test_all_ranks_succeed() -> None:
    _run([(True, None), (True, None)])


def test_all_ranks_refuse_raises_the_lowest_ranks_refusal() -> None:
    with pytest.raises(ValueError, match="rank0 refused") as info:
        _run([(False, ValueError("rank0 refused")), (False, ValueError("rank1 refused"))])
    assert not isinstance(info.value, EngineStepError)


@pytest.mark.parametrize("outcomes", [
    [(True, None), (False, ValueError("refused on rank 1 only"))],   # rank 0 loaded, rank 1 did not
    [(False, ValueError("refused on rank 0 only")), (True, None)],
    [(False, RuntimeError("failed midway")), (False, RuntimeError("failed midway"))],  # partly updated
    [(False, ValueError("refused")), (False, RuntimeError("failed midway"))],
])
def test_mixed_or_partial_outcomes_are_fatal(outcomes: list[tuple[bool, Any]]) -> None:
    with pytest.raises(WeightsOutOfStepError, match="ranks' weights may now differ") as info:
        _run(outcomes)
    assert isinstance(info.value, EngineStepError)  # what core_proc treats as fatal
    for ok, value in outcomes:
        if not ok:
            assert str(value) in str(info.value)


@pytest.mark.parametrize("error", [ValueError("refused"), RuntimeError("failed midway")])
def test_one_rank_raises_its_own_error(error: Exception) -> None:
    with pytest.raises(type(error)) as info:
        _run([(False, error)])
    assert info.value is error
