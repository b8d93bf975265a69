"""Weight changes across tensor-parallel ranks: every rank ends with the same checkpoint's shards, or the engine
stops.

A weight-changing worker call (a load from disk, `update_weights`, a broadcast receive) runs on every rank, and
each rank either succeeds, refuses with a ValueError (the worker's convention, vllm/v1/worker/weight_update.py: a
ValueError means this rank changed no weight) or fails otherwise (a RuntimeError: its weights may be partly
updated). `run_weight_change` judges the ranks' outcomes together.

Invariants:
- Every rank succeeded: the change holds.
- Every rank refused: no weight changed anywhere; the lowest rank's error is raised and the engine keeps serving
  its weights.
- Any other outcome with several ranks (one rank loaded while another refused; a rank failed midway): the ranks
  may hold shards of different checkpoints, and no step may compute with them. WeightsOutOfStepError, an
  EngineStepError, is fatal for the engine core (core_proc.py): the engine stops, its clients get
  EngineDeadError carrying this error's text, and the update's caller restarts it. Safer than a halt that waits
  for a good update: a halted engine holds its requests with no end, and a later update may not cover every
  weight the failed one touched.
- One rank: its error is raised as it is (a partial update there is the worker's documented behaviour).

An update received from a trainer's group (`update_weights` over nccl) is a collective with the trainer and every
worker: a rank that refuses while the others enter it leaves them, and the trainer, waiting in the broadcast. So
`update_weights_all_or_none` agrees first: every rank checks the whole update's metadata (names, shapes, dtypes,
its weights awake, its group joined) without moving a byte, and only when every rank accepts does any rank
receive. A refused update is then received and dropped by every rank (`discard_weight_update`) when every rank
can (its layout parses and every rank joined the group), so the trainer's send completes and the group stays in
step; the call raises the refusal (VLLMValidationError, HTTP 400) with what happened to the trainer's bytes. A
drop that fails on some rank raises WeightDrainError, the one error the refusal's caller catches around it (no
weight changed; the group may be out of step); a worker that dies meanwhile is EngineDeadError, which goes up as
it is, never as a refusal. The data-parallel client (dp_client.py) makes the engines agree the same way through
the engine core's `check_weight_update` / `discard_weight_update`. Joining the trainer's group
(`init_weight_transfer_engine`, a rendezvous of every worker) is agreed likewise: every rank checks the init_info
(its keys, its own place in the group) before any rank joins (`init_transfer_all_or_none`; the engine core's
`check_weight_transfer_init` for the data-parallel client).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.v1.engine import EngineStepError
from vllm.v1.engine.core_client import EngineDeadError

if TYPE_CHECKING:  # NOTE: the frontend's DP client imports this module; it loads no worker code
    from vllm.v1.executor.abstract import Executor


class WeightsOutOfStepError(EngineStepError):
    """A weight change failed on some tensor-parallel ranks only, or midway (or, raised by the data-parallel
    client, was applied by some engines only): the ranks' or engines' weights may differ."""


class WeightDrainError(RuntimeError):
    """Receiving a refused update from the trainer's group to drop it failed on some rank or engine: no weight
    changed, but the group may be out of step with the trainer. Raised by the drop alone, so that catching it
    catches nothing else (EngineDeadError, EngineStepError)."""


def run_weight_change(executor: Executor, method: str, *args: Any) -> None:
    """Run the worker's weight-changing `method` on every rank; raise as the module docstring says."""
    outcomes = executor.run_workers_outcomes(method, *args)
    errors = [(rank, value) for rank, (ok, value) in enumerate(outcomes) if not ok]
    if not errors:
        return
    all_refused = len(errors) == len(outcomes) and all(isinstance(e, ValueError) for _, e in errors)
    if len(outcomes) == 1 or all_refused:
        raise errors[0][1]
    failed = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in errors)
    raise WeightsOutOfStepError(
        f"The weight update ({method}) failed on {len(errors)} of {len(outcomes)} tensor-parallel ranks after "
        f"others may have changed their weights ({failed}). The ranks' weights may now differ, so the engine "
        "stops instead of serving them: restart it.")


def check_weight_update(executor: Executor, update_info: Any) -> tuple[str | None, bool]:
    """Every rank's checks of `update_weights(update_info)`, nothing moved: (the refusal's text, None when every
    rank would take the update; whether every rank can receive the update's bytes and drop them)."""
    outcomes = executor.run_workers_outcomes("check_weight_update", update_info)
    problems: list[tuple[int, str]] = []
    receivable = True
    for rank, (ok, value) in enumerate(outcomes):
        if not ok:
            problems.append((rank, f"{type(value).__name__}: {value}"))
            receivable = False
            continue
        problem, rank_receivable = value
        receivable = receivable and bool(rank_receivable)
        if problem is not None:
            problems.append((rank, problem))
    if not problems:
        return None, receivable
    return refusal_text(problems, len(outcomes), "tensor-parallel rank"), receivable


def refusal_text(problems: list[tuple[int, str]], num_parts: int, part: str, what: str = "Weight update") -> str:
    """One text for the refusals of some of `num_parts` parts (`part`: "tensor-parallel rank", "data-parallel
    engine"): the refusal itself when there is one part or all refused alike, else each refusing part's."""
    if num_parts == 1 or (len(problems) == num_parts and len({text for _, text in problems}) == 1):
        return problems[0][1]
    each = "; ".join(f"{part.split()[-1]} {i}: {text}" for i, text in problems)
    return f"{what} refused by {len(problems)} of {num_parts} {part}s, so none took it ({each})."


def discard_weight_update(executor: Executor, update_info: Any) -> None:
    """Every rank receives the refused update from the trainer's group and drops it; WeightDrainError naming the
    ranks where that failed (no weight changed anywhere). A dead worker's EngineDeadError, or an EngineStepError,
    is raised as it is."""
    outcomes = executor.run_workers_outcomes("discard_weight_update", update_info)
    for ok, e in outcomes:
        if not ok and isinstance(e, (EngineDeadError, EngineStepError)):
            raise e
    errors = [f"rank {rank}: {type(e).__name__}: {e}" for rank, (ok, e) in enumerate(outcomes) if not ok]
    if errors:
        raise WeightDrainError("; ".join(errors))


def refused(problem: str, backend: str, drained: bool | BaseException) -> VLLMValidationError:
    """The error of a refused update, saying what became of the trainer's bytes (`drained`: True when every
    worker received and dropped them; an exception when that failed, which becomes the error's cause; False when
    nothing was received)."""
    again = ("initialise the weight transfer again (init_weight_transfer_engine, and trainer_init on a new port) "
             "before the next update.")
    if drained is True:
        note = ("Every worker received this update from the trainer's group and dropped it, so the trainer's send "
                "completes and the group stays in step: correct the update and send it again.")
    elif isinstance(drained, BaseException):
        note = (f"Receiving this update from the trainer's group to drop it failed ({drained}); no weight changed, "
                f"but the group may be out of step with the trainer: {again}")
    elif backend == "nccl":
        note = ("Nothing of this update was received: a trainer sending it waits in its broadcast until the "
                f"group's timeout; then {again}")
    else:
        note = ""
    if note and not problem.rstrip().endswith((".", ")")):
        problem = problem.rstrip() + "."
    error = VLLMValidationError(f"{problem} {note}".strip(), parameter="update_info")
    if isinstance(drained, BaseException):
        error.__cause__ = drained
    return error


def transfer_backend(vllm_config: Any) -> str:
    """The weight-transfer backend the engine was configured with ("nccl" when none was)."""
    config = getattr(vllm_config, "weight_transfer_config", None)
    return config.backend if config is not None else "nccl"


def update_weights_all_or_none(executor: Executor, update_info: Any) -> None:
    """`update_weights(update_info)` on every rank once every rank accepted it; else no rank receives it into
    its weights and the refusal is raised (the trainer's bytes dropped where every rank can receive them)."""
    problem, receivable = check_weight_update(executor, update_info)
    if problem is None:
        run_weight_change(executor, "update_weights", update_info)
        return
    drained: bool | WeightDrainError = False
    if receivable:
        try:
            discard_weight_update(executor, update_info)
            drained = True
        except WeightDrainError as e:
            drained = e
    raise refused(problem, transfer_backend(executor.vllm_config), drained)


NO_UPDATE = "No weight update is in progress: call start_weight_update first."


def no_update_in_progress(executor: Executor) -> VLLMValidationError:
    """update_weights outside start_weight_update / finish_weight_update: a refusal like any other (nothing of
    the update is received)."""
    return refused(NO_UPDATE, transfer_backend(executor.vllm_config), False)


JOIN = "Joining the trainer's weight-transfer group"
TRANSFER_INIT_REFUSED_NOTE = ("No worker joined the trainer's group: a trainer already in trainer_init waits until "
                              "its timeout_s and then fails; call both again with a corrected init_info.")


def check_transfer_init(executor: Executor, init_info: Any) -> str | None:
    """Every rank's checks of `init_weight_transfer_engine(init_info)`, no group joined: the refusal's text, or
    None when every rank would join."""
    outcomes = executor.run_workers_outcomes("check_weight_transfer_init", init_info)
    problems = [(rank, str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}")
                for rank, (ok, e) in enumerate(outcomes) if not ok]
    return refusal_text(problems, len(outcomes), "tensor-parallel rank", JOIN) if problems else None


def init_transfer_all_or_none(executor: Executor, init_info: Any) -> None:
    """Every rank joins the trainer's group once every rank's check passed; else none does and the refusal is
    raised (VLLMValidationError), so no rank waits in the rendezvous for one that refused."""
    problem = check_transfer_init(executor, init_info)
    if problem is not None:
        raise transfer_init_refused(problem)
    executor.run_workers("init_weight_transfer_engine", init_info)


def transfer_init_refused(problem: str) -> VLLMValidationError:
    if not problem.rstrip().endswith((".", ")")):
        problem = problem.rstrip() + "."
    return VLLMValidationError(f"{problem} {TRANSFER_INIT_REFUSED_NOTE}", parameter="init_info")
