"""Starting engine-core processes: one per data-parallel rank, each reachable by every frontend (API server).

`launch_engine_cores(vllm_config, num_clients)` starts `data_parallel_size` engine cores and returns one
`EngineCoreHandle` per client. Addresses (ipc:// in a private temp dir): client c binds one input address per
engine (`input{c}-{e}`) and one output address (`output{c}`) that every engine pushes to; engine e connects to
`input{c}-{e}` and `output{c}` of every client c. So each client talks to every engine (vLLM's layout with
--api-server-count and --data-parallel-size together), and an engine's outputs reach only the client that sent
each request (core_proc.py).

Invariants:
- Engine e gets its own copy of the config with `parallel_config.data_parallel_rank = e` (the frontends keep
  rank 0) and is named `EngineCore_DP{e}` when there are several.
- On CUDA each engine sees only its own devices: engine e starts with CUDA_VISIBLE_DEVICES set to the e-th run
  of `tensor_parallel_size` devices among those visible to the launcher, so its workers number them from 0. Too
  few devices is a ValueError before anything starts. On CPU every engine runs on the CPU.
- The caller owns the processes: it must reap one that dies (`join`) and stop them all at the end, then remove
  the temp dir.
"""

from __future__ import annotations

import contextlib
import copy
import multiprocessing
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.engine.core_proc import run_engine_core


@dataclass(frozen=True)
class EngineCoreHandle:
    """How one frontend reaches the engine cores of `launch_engine_cores` (picklable, for spawned API servers)."""
    # One per engine core, in rank order.
    input_addresses: tuple[str, ...]
    output_address: str
    core_pids: tuple[int, ...]
    client_index: int
    num_clients: int = 1

    @property
    def data_parallel_size(self) -> int:
        return len(self.input_addresses)


def data_parallel_size_of(vllm_config: VllmConfig | None) -> int:
    """The number of engine cores a config asks for (1 for the test fakes' None config)."""
    if vllm_config is None:
        return 1
    return int(vllm_config.parallel_config.data_parallel_size)


def engine_config(vllm_config: VllmConfig | None, rank: int) -> VllmConfig | None:
    """Engine `rank`'s own config: a deep copy with parallel_config.data_parallel_rank = rank (rank 0 with one
    engine: the config itself)."""
    if vllm_config is None or data_parallel_size_of(vllm_config) == 1:
        return vllm_config
    config = copy.deepcopy(vllm_config)
    config.parallel_config.data_parallel_rank = rank
    return config


def device_env(vllm_config: VllmConfig | None, visible: list[str] | None = None) -> list[dict[str, str]]:
    """The environment variables each engine core starts with, in rank order (empty dicts on CPU). visible: the
    CUDA devices the launcher sees (default: CUDA_VISIBLE_DEVICES, else every device torch counts)."""
    num_engines = data_parallel_size_of(vllm_config)
    if vllm_config is None or num_engines == 1:
        return [{} for _ in range(num_engines)]
    device = str(vllm_config.device_config.device)
    if not device.startswith("cuda"):
        return [{} for _ in range(num_engines)]
    if device != "cuda":
        raise ValueError(f"data_parallel_size={num_engines} gives each engine its own devices: use device=cuda "
                         f"(or auto), not {device!r}.")
    if visible is None:
        env_value = os.environ.get("CUDA_VISIBLE_DEVICES")
        if env_value is not None:
            visible = [d.strip() for d in env_value.split(",") if d.strip()]
        else:
            import torch
            visible = [str(i) for i in range(torch.cuda.device_count())]
    per_engine = int(vllm_config.parallel_config.tensor_parallel_size)
    needed = num_engines * per_engine
    if len(visible) < needed:
        raise ValueError(f"data_parallel_size={num_engines} x tensor_parallel_size={per_engine} needs {needed} GPUs; "
                         f"{len(visible)} are visible ({','.join(visible) or 'none'}).")
    return [{"CUDA_VISIBLE_DEVICES": ",".join(visible[e * per_engine:(e + 1) * per_engine])}
            for e in range(num_engines)]


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set while a child is started (a spawned child copies the environment)."""
    previous = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in previous.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def launch_engine_cores(vllm_config: VllmConfig | None, num_clients: int,
                        engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                        start_method: str = "spawn", data_parallel_size: int | None = None
                        ) -> tuple[list[multiprocessing.process.BaseProcess], list[EngineCoreHandle], str]:
    """Start the engine cores (data_parallel_size of them: the config's unless given) for `num_clients`
    frontends -> (processes in rank order, one handle per client, the temp dir of the ipc addresses)."""
    num_engines = data_parallel_size if data_parallel_size is not None else data_parallel_size_of(vllm_config)
    envs = device_env(vllm_config) if data_parallel_size is None else [{} for _ in range(num_engines)]
    tmp_dir = tempfile.mkdtemp(prefix="vllm-core-")
    inputs = [[f"ipc://{os.path.join(tmp_dir, f'input{c}-{e}')}" for e in range(num_engines)]
              for c in range(num_clients)]
    outputs = [f"ipc://{os.path.join(tmp_dir, f'output{c}')}" for c in range(num_clients)]
    context = multiprocessing.get_context(start_method)
    procs: list[multiprocessing.process.BaseProcess] = []
    try:
        for e in range(num_engines):
            proc = context.Process(
                target=run_engine_core, name="EngineCore" if num_engines == 1 else f"EngineCore_DP{e}", daemon=True,
                args=(engine_config(vllm_config, e), [inputs[c][e] for c in range(num_clients)], outputs,
                      os.getpid(), engine_core_factory),
                kwargs={"engine_index": e})
            with _environ(envs[e]):
                proc.start()
            procs.append(proc)
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.join(5)
        raise
    pids = tuple(int(p.pid) for p in procs if p.pid is not None)
    handles = [EngineCoreHandle(tuple(inputs[c]), outputs[c], pids, c, num_clients) for c in range(num_clients)]
    return procs, handles, tmp_dir


def launch_engine_core(vllm_config: VllmConfig | None, num_clients: int,
                       engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                       start_method: str = "spawn") -> tuple[multiprocessing.process.BaseProcess,
                                                             list[EngineCoreHandle], str]:
    """One engine core for `num_clients` frontends (--api-server-count without data parallel) -> (its process,
    one handle per client, the temp dir)."""
    procs, handles, tmp_dir = launch_engine_cores(vllm_config, num_clients, engine_core_factory, start_method,
                                                  data_parallel_size=1)
    return procs[0], handles, tmp_dir


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # NOTE: a dead child its parent has not reaped yet is a zombie, still signalable.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
