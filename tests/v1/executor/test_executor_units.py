"""The executors' pieces that need no engine: the backend a config gets (one rank: UniProcExecutor whatever the
backend), a remote rank's reply to the driver (it must survive the pickle round trip the driver's gather does),
the CUDA index the Ray driver takes for the GPU Ray gives it (its position in CUDA_VISIBLE_DEVICES), and a CPU
rank's intra-op threads."""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from typing import Any

import pytest

from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.distributed import _reply
from vllm.v1.executor.ray_distributed_executor import driver_cuda_index
from vllm.v1.worker import worker as worker_mod


def _config(backend: str, world_size: int) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend,
                                                           world_size=world_size))


@pytest.mark.parametrize("backend, world_size, want", [
    ("uni", 1, "UniProcExecutor"), ("mp", 1, "UniProcExecutor"), ("ray", 1, "UniProcExecutor"),
    ("mp", 2, "MultiprocExecutor"), ("ray", 2, "RayDistributedExecutor"),
])
def test_executor_class(backend: str, world_size: int, want: str) -> None:
    assert Executor.get_class(_config(backend, world_size)).__name__ == want


class TwoArgError(Exception):
    """Pickles (as TwoArgError(message)) but does not unpickle: __init__ needs two arguments."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}-{b}")


def _raise_two_arg() -> None:
    raise TwoArgError("left", "right")


def test_reply_survives_the_round_trip() -> None:
    pickle.dumps(TwoArgError("left", "right"))  # the old check passed this
    with pytest.raises(TypeError):
        pickle.loads(pickle.dumps(TwoArgError("left", "right")))
    worker = SimpleNamespace(rank=3, boom=_raise_two_arg, double=lambda x: 2 * x)
    ok, error = pickle.loads(pickle.dumps(_reply(worker, "boom", (), {}, False)))  # type: ignore[arg-type]
    assert not ok and isinstance(error, RuntimeError)
    assert "rank 3" in str(error) and "left-right" in str(error) and "TwoArgError" in str(error)
    # A reply that travels is left as it is.
    assert _reply(worker, "double", (3,), {}, False) == (True, 6)  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu_id, visible, want", [
    ("0", None, 0), ("5", None, 5), ("3", "", 3),
    ("2", "2,3", 0), ("3", "2,3", 1), ("6", "7, 6,5", 1),
    ("GPU-abc", "GPU-xyz,GPU-abc", 1),
])
def test_driver_cuda_index(gpu_id: str, visible: str | None, want: int) -> None:
    assert driver_cuda_index(gpu_id, visible) == want


def test_driver_cuda_index_of_a_hidden_gpu() -> None:
    with pytest.raises(RuntimeError, match="hides"):
        driver_cuda_index("1", "2,3")


@pytest.mark.parametrize("cores, threads, world_size, want", [
    (16, 16, 2, 8),   # torch's default: the node's cores split between the ranks
    (16, 16, 4, 4),
    (16, 1, 2, 1),    # OMP_NUM_THREADS=1 (the tests' setting) stays 1 on a 16-core GPU host
    (16, 3, 2, 3),
    (2, 2, 4, 1),     # more ranks than cores: one thread each
])
def test_cpu_threads_per_rank(monkeypatch: pytest.MonkeyPatch, cores: int, threads: int, world_size: int,
                              want: int) -> None:
    monkeypatch.setattr(worker_mod.os, "cpu_count", lambda: cores)
    monkeypatch.setattr(worker_mod.torch, "get_num_threads", lambda: threads)
    assert worker_mod.cpu_threads_per_rank(world_size) == want


@pytest.mark.parametrize("dp, threads_before, want", [(1, 16, 16), (2, 16, 8), (2, 1, 1)])
def test_a_cpu_engine_worker_takes_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, dp: int,
                                                          threads_before: int, want: int) -> None:
    """A Worker on CPU, one of `dp` data-parallel engines on a 16-core node: torch's threads set to its share (one
    engine: left as they are)."""
    import torch

    from vllm.engine.arg_utils import EngineArgs
    config = EngineArgs(device="cpu", max_model_len=128, max_num_seqs=2, data_parallel_size=dp).create_engine_config()
    threads = {"n": threads_before}
    monkeypatch.setattr(worker_mod.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: threads.update(n=n))
    worker_mod.Worker(config)
    assert threads["n"] == want
