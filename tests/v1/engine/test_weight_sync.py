"""weight_sync.run_weight_change judges the ranks' outcomes of a weight change together (hand-worked cases): all
succeeded -> nothing raised; all refused (ValueError: no rank changed) -> the lowest rank's refusal, the engine
serves on; any other mix with several ranks -> WeightsOutOfStepError (fatal, an EngineStepError); one rank -> its
own error as it is. update_weights_all_or_none agrees before any rank receives (hand-worked call sequences): every
rank accepts -> check, then update; any rank refuses -> no rank's update_weights runs, every rank drops the
trainer's bytes when every rank can receive them, and the refusal (VLLMValidationError) says which ranks refused
and what became of the trainer's bytes; a drop that fails is a WeightDrainError inside that refusal, but a worker
that dies during the drop is EngineDeadError, never a refusal; update_weights outside an update is that refusal too.
init_transfer_all_or_none: no rank joins the trainer's group unless every rank's check passed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from vllm.exceptions import VLLMValidationError
from vllm.v1.engine import EngineStepError
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.engine.weight_sync import (WeightDrainError, WeightsOutOfStepError, init_transfer_all_or_none,
                                        run_weight_change, update_weights_all_or_none)


class FakeExecutor:
    """Answers every call with `outcomes`, or, per method, with `by_method[method]`."""

    def __init__(self, outcomes: list[tuple[bool, Any]], by_method: dict[str, list[tuple[bool, Any]]] | None = None,
                 backend: str = "nccl") -> None:
        self.outcomes = outcomes
        self.by_method = by_method or {}
        self.calls: list[tuple[str, tuple]] = []
        self.vllm_config = SimpleNamespace(weight_transfer_config=SimpleNamespace(backend=backend))

    def run_workers_outcomes(self, method: str, *args: Any) -> list[tuple[bool, Any]]:
        """An exception in place of the outcomes is raised (as the distributed executor raises EngineDeadError
        when a worker died)."""
        self.calls.append((method, args))
        outcomes = self.by_method.get(method, self.outcomes)
        if isinstance(outcomes, BaseException):
            raise outcomes
        return outcomes

    def run_workers(self, method: str, *args: Any) -> list[Any]:
        return [value for _, value in self.run_workers_outcomes(method, *args)]


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


INFO = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}


def _update(checks: list[tuple[bool, Any]], backend: str = "nccl",
            discards: list[tuple[bool, Any]] | BaseException | None = None
            ) -> tuple[FakeExecutor, BaseException | None]:
    executor = FakeExecutor([(True, None)] * len(checks), {"check_weight_update": checks,
                                                           **({"discard_weight_update": discards} if discards else {})},
                            backend)
    try:
        update_weights_all_or_none(executor, INFO)  # type: ignore[arg-type]
    except BaseException as e:  # noqa: BLE001
        return executor, e
    return executor, None


def _methods(executor: FakeExecutor) -> list[str]:
    assert all(args == (INFO,) for _, args in executor.calls)
    return [method for method, _ in executor.calls]


def test_every_rank_accepts_then_every_rank_receives() -> None:
    executor, error = _update([(True, (None, True)), (True, (None, True))])
    assert error is None and _methods(executor) == ["check_weight_update", "update_weights"]


def test_one_rank_refusing_keeps_every_rank_out_of_the_update_and_drops_the_bytes() -> None:
    """The case that hung: rank 0 would have entered the trainer's broadcast while rank 1 refused."""
    executor, error = _update([(True, (None, True)), (True, ("rank 1 has no such weight", True))])
    assert _methods(executor) == ["check_weight_update", "discard_weight_update"]
    assert isinstance(error, VLLMValidationError) and not isinstance(error, EngineStepError)
    text = str(error)
    assert "refused by 1 of 2 tensor-parallel ranks" in text and "rank 1: rank 1 has no such weight" in text
    assert "received this update from the trainer's group and dropped it" in text


def test_every_rank_refusing_alike_gives_that_refusal() -> None:
    executor, error = _update([(True, ("no such weight", True))] * 2)
    assert _methods(executor) == ["check_weight_update", "discard_weight_update"]
    assert str(error).startswith("no such weight. Every worker received")


@pytest.mark.parametrize("checks", [
    [(True, (None, True)), (True, ("update_info.dtype_names[0]: unknown dtype name", False))],  # layout unknown
    [(True, (None, True)), (False, RuntimeError("rank 1 broke while checking"))],              # no verdict
])
def test_a_rank_that_cannot_receive_means_no_rank_receives(checks: list[tuple[bool, Any]]) -> None:
    """Draining on some ranks only would leave them waiting in the broadcast: nothing is received anywhere."""
    executor, error = _update(checks)
    assert _methods(executor) == ["check_weight_update"]
    assert isinstance(error, VLLMValidationError) and "Nothing of this update was received" in str(error)
    assert "trainer_init on a new port" in str(error)


def test_a_failed_drop_is_still_a_refusal_naming_the_failure() -> None:
    executor, error = _update([(True, ("no such weight", True))] * 2,
                              discards=[(True, None), (False, RuntimeError("connection reset"))])
    assert _methods(executor) == ["check_weight_update", "discard_weight_update"]
    assert isinstance(error, VLLMValidationError)
    assert "to drop it failed (rank 1: RuntimeError: connection reset); no weight changed" in str(error)
    assert "trainer_init on a new port" in str(error)
    assert isinstance(error.__cause__, WeightDrainError)


@pytest.mark.parametrize("discards", [
    EngineDeadError("A tensor-parallel worker failed: rank 1 exited"),                # the executor raises it
    [(True, None), (False, EngineDeadError("A tensor-parallel worker failed: rank 1 exited"))],  # a rank's outcome
    [(False, EngineStepError("a step failed")), (True, None)],
])
def test_a_dead_worker_during_the_drop_is_not_a_refusal(discards: Any) -> None:
    """A worker that dies while the refused update is dropped is the engine's death, not 'no weight changed'."""
    executor, error = _update([(True, ("no such weight", True))] * 2, discards=discards)
    assert _methods(executor) == ["check_weight_update", "discard_weight_update"]
    assert isinstance(error, (EngineDeadError, EngineStepError)) and not isinstance(error, ValueError)
    assert "rank 1 exited" in str(error) or "a step failed" in str(error)


def test_the_engine_core_outside_an_update() -> None:
    """update_weights before start_weight_update is the same refusal the data-parallel client's check gives
    (nothing received: an nccl trainer waits until its timeout); the drop there is a WeightDrainError."""
    executor = FakeExecutor([(True, None)])
    core = SimpleNamespace(updating_weights=False, model_executor=executor)
    with pytest.raises(VLLMValidationError, match=r"^No weight update is in progress: call start_weight_update "
                                                  r"first\. Nothing of this update was received") as info:
        EngineCore.update_weights(core, INFO)  # type: ignore[arg-type]
    assert info.value.parameter == "update_info"
    with pytest.raises(WeightDrainError, match="No weight update is in progress on this engine"):
        EngineCore.discard_weight_update(core, INFO)  # type: ignore[arg-type]
    assert executor.calls == []


def test_ipc_and_disk_refusals_say_nothing_of_a_broadcast() -> None:
    executor, error = _update([(True, ("no such weight", False))], backend="ipc")
    assert _methods(executor) == ["check_weight_update"]
    assert str(error) == "no such weight (parameter=update_info)"


def test_no_rank_joins_the_trainers_group_unless_every_rank_would() -> None:
    init_info = {"rank_offset": 1, "world_size": 2}
    executor = FakeExecutor([(True, None)] * 2, {"check_weight_transfer_init": [
        (True, None), (False, ValueError("init_info.rank_offset (1) + this worker's rank (1) must be below "
                                         "init_info.world_size (2)."))]})
    with pytest.raises(VLLMValidationError, match=r"Joining the trainer's weight-transfer group refused by 1 of 2 "
                                                  r"tensor-parallel ranks.*rank 1: init_info"
                                                  r".*No worker joined the trainer's group") as info:
        init_transfer_all_or_none(executor, init_info)  # type: ignore[arg-type]
    assert info.value.parameter == "init_info"
    assert [m for m, _ in executor.calls] == ["check_weight_transfer_init"]
    executor = FakeExecutor([(True, None)] * 2)
    init_transfer_all_or_none(executor, init_info)  # type: ignore[arg-type]
    assert executor.calls == [("check_weight_transfer_init", (init_info,)), ("init_weight_transfer_engine",
                                                                             (init_info,))]
