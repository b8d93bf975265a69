"""Worker extensions whose rank FailOnRank<r>'s warm-up (compile_or_warm_up_model) fails while the other ranks
wait in a collective of the tensor-parallel group, as a warm-up forward's all_reduce would (the start-up failure
tests). Importing this module wraps Worker.compile_or_warm_up_model; workers of other classes are untouched."""

from __future__ import annotations

import torch
import torch.distributed as dist

from vllm.distributed.parallel_state import get_tp_group
from vllm.v1.worker.worker import Worker

_PREFIX = "Worker[FailOnRank"
_original = Worker.compile_or_warm_up_model


def _compile_or_warm_up_model(self: Worker) -> None:
    name = type(self).__name__
    if name.startswith(_PREFIX):
        if self.rank == int(name[len(_PREFIX):-1]):
            raise RuntimeError(f"simulated warm-up failure on rank {self.rank}")
        dist.all_reduce(torch.ones(1), group=get_tp_group().device_group)  # never completed: a rank is missing
    _original(self)


if getattr(Worker.compile_or_warm_up_model, "__name__", "") != "_compile_or_warm_up_model":
    Worker.compile_or_warm_up_model = _compile_or_warm_up_model  # type: ignore[method-assign]


class FailOnRank0:
    def fail_probe(self) -> str:
        return "loaded"


class FailOnRank1:
    def fail_probe(self) -> str:
        return "loaded"
