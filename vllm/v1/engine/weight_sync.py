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
"""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import EngineStepError
from vllm.v1.executor.abstract import Executor


class WeightsOutOfStepError(EngineStepError):
    """A weight change failed on some tensor-parallel ranks only, or midway: the ranks' weights may differ."""


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
