"""RayDistributedExecutor ("ray"): rank 0 in the engine core's process, ranks 1..N-1 Ray actors of a placement group.

The engine core joins the Ray cluster named by RAY_ADDRESS (Ray reads it; `ray start --head` makes one across
nodes), or starts a local Ray instance when it is unset. A placement group holds one bundle per rank ({"GPU": 1}
on CUDA, {"CPU": 1} on CPU), packed; the driver (rank 0) takes one on this node (there must be one), and ranks
1..N-1 the others, in bundle order, one actor each (on CUDA the driver's bundle holds a small actor that keeps
its GPU from the others; the driver runs on that GPU, found by its id in this process's CUDA_VISIBLE_DEVICES:
`driver_cuda_index`). An actor builds the worker of its rank (on CUDA, on the one GPU Ray gives it: local_rank 0
of its CUDA_VISIBLE_DEVICES), joins the world at tcp://<this node's IP>:port, and runs the same step loop as a
spawned worker (vllm/v1/executor/distributed.py), so steps and collective_rpc travel over torch.distributed here
too.

Invariants:
- Each actor's `start` call returns only when its loop ends; a call that finishes (or fails: a dead actor) before
  shutdown is a dead worker (`_worker_failure`, checked by a monitor thread), and the executor then fails as the
  multiprocess one does (EngineDeadError; in an engine core's own process, the process ends).
- Shutdown sends the shutdown message, waits for the loops to end, kills the actors, removes the placement group,
  and stops Ray when this executor started it.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from vllm.config import VllmConfig
from vllm.utils import get_open_port
from vllm.v1.executor.distributed import DistributedExecutorBase, run_worker_loop

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 300.0
_JOIN_TIMEOUT_S = 10.0
_EXIT_AFTER_FAILURE_S = 1.0


class RayWorkerWrapper:
    """The actor class of ranks 1..N-1 (made remote when the executor starts, so that importing this module needs
    no Ray)."""

    def start(self, vllm_config: VllmConfig, rank: int, distributed_init_method: str) -> None:
        logging.basicConfig(level=logging.INFO,
                            format=f"%(levelname)s %(asctime)s [rank {rank}] %(name)s: %(message)s")
        from vllm.distributed.parallel_state import destroy_distributed_environment
        from vllm.v1.worker.worker import make_worker
        worker = make_worker(vllm_config, rank, 0, distributed_init_method)
        try:
            run_worker_loop(worker)
        except BaseException:
            # NOTE: a start-up call failed (distributed.py): the actor's process must end, as a spawned worker's
            # does, so that the driver's collectives with it fail at once; the error first travels as this call's
            # result.
            threading.Timer(_EXIT_AFTER_FAILURE_S, os._exit, (1,)).start()
            raise
        destroy_distributed_environment()


class RayGpuHolder:
    """An actor in the driver's bundle on CUDA: it holds that bundle's GPU, so Ray gives it to no other actor, and
    tells its id, which the driver (not an actor: it sees every GPU of the node) then uses."""

    def gpu_id(self) -> str:
        import ray
        return str(ray.get_gpu_ids()[0])


def driver_cuda_index(ray_gpu_id: str, cuda_visible_devices: str | None) -> int:
    """torch's device index, in the engine core's process, of the GPU Ray calls `ray_gpu_id`.
    NOTE: Ray numbers GPUs as the CUDA_VISIBLE_DEVICES it was started with lists them (or the node's numbering
    without one), torch as this process's CUDA_VISIBLE_DEVICES orders them: the position of the id in that list."""
    if not cuda_visible_devices:
        return int(ray_gpu_id)
    visible = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if ray_gpu_id not in visible:
        raise RuntimeError(f"Ray gave the driver GPU {ray_gpu_id}, which this process's CUDA_VISIBLE_DEVICES "
                           f"({cuda_visible_devices!r}) hides; start Ray and the engine with the same "
                           "CUDA_VISIBLE_DEVICES.")
    return visible.index(ray_gpu_id)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'vllm[ray]' (or ray).") from None
    return ray


class RayDistributedExecutor(DistributedExecutorBase):
    uses_ray = True

    def _start_workers(self) -> str:
        ray = _import_ray()
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        on_cuda = self.vllm_config.device_config.device.startswith("cuda")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            # NOTE: ray.init reads RAY_ADDRESS itself (an existing cluster); without it, a local instance with at
            # least one logical CPU per rank.
            local = not os.environ.get("RAY_ADDRESS")
            ray.init(include_dashboard=False, configure_logging=False,
                     **({"num_cpus": max(os.cpu_count() or 1, self.world_size)} if local and not on_cuda else {}))
        bundle = {"GPU": 1.0} if on_cuda else {"CPU": 1.0}
        node_id = ray.get_runtime_context().get_node_id()
        self._pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        self._actors: list[Any] = []
        self._refs: list[Any] = []
        try:
            ray.get(self._pg.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except Exception as e:
            self._release_ray()
            raise RuntimeError(f"Ray could not place {self.world_size} bundles of {bundle} within "
                               f"{_PLACEMENT_TIMEOUT_S:.0f} s ({type(e).__name__}); the cluster has "
                               f"{ray.cluster_resources()}.") from None
        bundle_nodes = placement_group_table(self._pg)["bundles_to_node_id"]
        local = [i for i in range(self.world_size) if bundle_nodes[i] == node_id]
        if not local:
            self._release_ray()
            raise RuntimeError(f"Ray placed no bundle on the engine core's node, where rank 0 runs; free one {bundle} "
                               "on this node.")
        # The driver takes a bundle of this node; ranks 1..N-1 the others, in bundle order.
        actor_bundles = [i for i in range(self.world_size) if i != local[0]]
        if on_cuda:
            holder = ray.remote(RayGpuHolder).options(
                num_cpus=0, num_gpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=local[0]),
            ).remote()
            self._actors.append(holder)
            self.driver_local_rank = driver_cuda_index(ray.get(holder.gpu_id.remote()),
                                                       os.environ.get("CUDA_VISIBLE_DEVICES"))
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{get_open_port()}"
        actor_cls = ray.remote(RayWorkerWrapper)
        for rank, bundle_index in enumerate(actor_bundles, start=1):
            actor = actor_cls.options(
                num_cpus=0 if on_cuda else 1, num_gpus=1 if on_cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg,
                                                                     placement_group_bundle_index=bundle_index),
            ).remote()
            self._actors.append(actor)
            self._refs.append(actor.start.remote(self.vllm_config, rank, init_method))
        self._monitor = threading.Thread(target=self._monitor_workers, name="VllmRayMonitor", daemon=True)
        self._monitor.start()
        return init_method

    def _worker_failure(self) -> str | None:
        ray = _import_ray()
        if not self._refs:
            return None
        done, _ = ray.wait(self._refs, num_returns=1, timeout=0)
        if not done:
            return None
        rank = self._refs.index(done[0]) + 1
        try:
            ray.get(done[0])
            error = "its loop ended"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        return f"Ray worker rank {rank} is gone ({error})"

    def _monitor_workers(self) -> None:
        ray = _import_ray()
        try:
            ray.wait(self._refs, num_returns=1)
        except Exception:  # NOTE: Ray itself going away (shutdown) ends the wait too
            pass
        self._worker_lost("a Ray worker is gone")

    def _stop_workers(self, graceful: bool) -> None:
        ray = _import_ray()
        if graceful and self._refs:
            ray.wait(self._refs, num_returns=len(self._refs), timeout=_JOIN_TIMEOUT_S)
        self._release_ray()

    def _release_ray(self) -> None:
        ray = _import_ray()
        from ray.util.placement_group import remove_placement_group
        for actor in getattr(self, "_actors", []):
            try:
                ray.kill(actor)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        self._actors, self._refs = [], []
        if getattr(self, "_pg", None) is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
