"""Worker: owns the device, the model runner and the KV cache; sizes the cache from the memory budget.

On CUDA the budget is gpu_memory_utilization of the device's memory minus what the weights and a profiled peak
of activations take, and with mixed CUDA graphs (on with CUDA graphs) minus their pool, the profiled
activations of a forward of the largest mixed size, which the captured graphs keep while eager steps still need
the profiled peak; on CPU it is kv_cache_memory_bytes (default VLLM_CPU_KVCACHE_SPACE GiB). Either way the
cache never holds more blocks than max_num_seqs full-length requests need. One more block than reported is
allocated: the model runner's scratch block for CUDA-graph padding rows.

The worker is also what RL frameworks reach through `collective_rpc` (`call`): its weight-update methods
(vllm/v1/worker/weight_update.py) and, with `worker_extension_cls`, the extension's methods, mixed into the
worker's class by `make_worker` (the worker's own attributes win; a clash is refused). Extensions read vLLM's
worker attributes: `model_runner` (its `.model`), `device`, `model_config`, `parallel_config`, `vllm_config`,
`rank`, `local_rank`.

With tensor_parallel_size > 1 there is one worker per rank (vllm/v1/executor/): each joins the engine's process
groups before its model is built, on its own device (cuda:local_rank, or the CPU over gloo), and sizes its own KV
cache; the executor keeps the smallest block count of all ranks.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.config.parallel import resolve_worker_extension
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.worker.async_output import AsyncModelRunnerOutput
from vllm.v1.worker.model_runner import ModelRunner
from vllm.v1.worker.sleep import Sleeper
from vllm.v1.worker.weight_update import WeightUpdater

logger = logging.getLogger(__name__)


def cpu_threads_per_rank(num_ranks: int) -> int:
    """Intra-op threads of one of `num_ranks` CPU ranks (tensor-parallel ranks times data-parallel engines): the
    node's cores shared by the ranks (torch's default, every core in every process, oversubscribes them; a parallel
    region then waits for descheduled threads), never more than this process already has (OMP_NUM_THREADS, which a
    rank's process inherits: the tests set 1)."""
    return max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // num_ranks))


class Worker:
    def __init__(self, vllm_config: VllmConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_method: str | None = None) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.parallel_config = vllm_config.parallel_config
        # vLLM's names for its place among the workers (vllm/v1/executor/); rank 0 is the driver.
        self.rank = rank
        self.local_rank = local_rank
        if self.parallel_config.world_size > 1:
            from vllm.v1.executor.distributed import init_worker_distributed_environment
            init_worker_distributed_environment(vllm_config, rank, local_rank, distributed_init_method)
        self.device = vllm_config.device_config.torch_device
        num_ranks = self.parallel_config.world_size * self.parallel_config.data_parallel_size
        if self.device.type == "cpu" and num_ranks > 1:
            torch.set_num_threads(cpu_threads_per_rank(num_ranks))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.model_runner = ModelRunner(vllm_config)
        self.model_runner.is_driver_worker = rank == 0
        # Sleep mode (vllm/v1/worker/sleep.py): the weights move into their own region now, the KV cache is made
        # in one; torch's peak then no longer counts the weights (determine_num_blocks adds them).
        self.sleeper = Sleeper(self.model_runner.model, self.device) if self.model_config.enable_sleep_mode else None
        if self.sleeper is not None and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.weight_updater = WeightUpdater(self.model_runner.model, vllm_config, self.device, self.rank)

    def determine_num_blocks(self) -> int:
        cc = self.vllm_config.cache_config
        runner = self.model_runner
        per_block = runner.kv_cache_bytes_per_block()
        max_useful = runner.max_num_reqs * runner.max_num_blocks_per_req
        if cc.num_gpu_blocks_override is not None:
            return cc.num_gpu_blocks_override
        if cc.kv_cache_memory_bytes is not None:
            budget = cc.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            runner.profile_run()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(self.device) + (self.sleeper.weight_bytes if self.sleeper else 0)
            # NOTE: after `peak` was read, as this profile resets the peak stats; 0 without mixed CUDA graphs.
            graph_bytes = runner.profile_mixed_graph_memory()
            _, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * cc.gpu_memory_utilization) - peak - graph_bytes
            torch.cuda.empty_cache()
            if graph_bytes:
                logger.info("Mixed CUDA graphs: %.2f GiB kept out of the KV cache", graph_bytes / (1 << 30))
        else:
            budget = int(envs.VLLM_CPU_KVCACHE_SPACE * (1 << 30))
        num_blocks = min(budget // per_block - 1, max_useful)  # NOTE: one block is the runner's scratch block
        if num_blocks < runner.max_num_blocks_per_req and num_blocks < max_useful:
            min_bytes = per_block * runner.max_num_blocks_per_req
            raise ValueError(
                f"The KV cache budget ({budget / (1 << 30):.2f} GiB) holds {max(num_blocks, 0)} blocks, fewer than one "
                f"request of max_model_len={runner.max_model_len} needs ({runner.max_num_blocks_per_req} blocks, "
                f"{min_bytes / (1 << 30):.2f} GiB). Raise gpu_memory_utilization or kv_cache_memory_bytes, or lower "
                "max_model_len.")
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, runner.block_size,
                    num_blocks * per_block / (1 << 30))
        return int(num_blocks)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks, self.sleeper.allocate_kv_cache if self.sleeper else None)

    def compile_or_warm_up_model(self) -> None:
        """Capture the CUDA graphs (CUDA without enforce_eager); call after initialize_kv_cache."""
        self.model_runner.capture_model()
        if self.parallel_config.world_size > 1:
            # NOTE: every rank samples the same gathered logits (vllm/v1/executor/distributed.py): the random state
            # must be the same on every rank from the first step on, whatever loading each shard consumed.
            torch.manual_seed(self.model_config.seed)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> AsyncModelRunnerOutput:
        return self.model_runner.execute_model_async(scheduler_output)

    # ------------------------------------------------------------------ collective_rpc and weight updates

    def call(self, method: str | Callable[..., Any], args: tuple = (), kwargs: dict[str, Any] | None = None) -> Any:
        """collective_rpc's work on this worker: a method by name (of the worker or its extension; not a private
        one), or a callable given the worker first."""
        if isinstance(method, str):
            if method in ENGINE_ONLY_METHODS:
                raise ValueError(f"collective_rpc: {method!r} is the engine's own step (it would break the running "
                                 "engine); weight updates go through start_weight_update / update_weights / "
                                 "finish_weight_update.")
            target = getattr(self, method, None) if not method.startswith("_") else None
            if not callable(target):
                raise ValueError(f"collective_rpc: the worker has no method {method!r} (worker methods and those of "
                                 "--worker-extension-cls can be called, not private ones).")
            try:
                inspect.signature(target).bind(*args, **(kwargs or {}))
            except TypeError as e:
                raise ValueError(f"collective_rpc: bad arguments for {method!r}: {e}") from None
            return target(*args, **(kwargs or {}))
        if not callable(method):
            raise ValueError(f"collective_rpc: method must be a name or a callable, got {type(method).__name__}.")
        return method(self, *args, **(kwargs or {}))

    # ---- sleep mode (vllm/v1/worker/sleep.py; the engine core halts and drains first, EngineSleepMixin)

    def sleep(self, level: int = 1) -> None:
        if self.sleeper is None:
            raise ValueError("Sleep mode is off: start the engine with enable_sleep_mode=True (--enable-sleep-mode).")
        self.sleeper.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleeper is not None:
            self.sleeper.wake_up(tags)

    def sleeping_tags(self) -> set[str]:
        return set(self.sleeper.asleep) if self.sleeper is not None else set()

    def _check_weights_awake(self) -> None:
        if self.sleeper is not None:
            self.sleeper.check_awake("weights", "update weights")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.weight_updater.init_transfer_engine(init_info)

    def check_weight_transfer_init(self, init_info: dict[str, Any]) -> None:
        """init_weight_transfer_engine's checks alone (ValueError); joins no group."""
        self.weight_updater.check_init(init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self.weight_updater.start(is_checkpoint_format)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._check_weights_awake()
        self.weight_updater.update(update_info)

    def check_weight_update(self, update_info: dict[str, Any]) -> tuple[str | None, bool]:
        """update_weights' checks alone, nothing moved (WeightUpdater.check_update): (refusal text or None,
        whether this rank can receive the update's bytes and drop them)."""
        try:
            self._check_weights_awake()
        except ValueError as e:
            return str(e), self.weight_updater.check_update(update_info)[1]
        return self.weight_updater.check_update(update_info)

    def discard_weight_update(self, update_info: dict[str, Any]) -> None:
        """Receive a refused update from the trainer's group and drop it (no weight changes)."""
        self.weight_updater.discard(update_info)

    def finish_weight_update(self) -> None:
        self.weight_updater.finish()

    def check_weights_from_disk(self, path: str) -> None:
        """Refuse (ValueError) a checkpoint folder this rank cannot load whole; changes nothing."""
        self.weight_updater.check_disk(path)

    def load_weights_from_disk(self, path: str) -> None:
        self._check_weights_awake()
        self.weight_updater.load_from_disk(path)

    def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                         timeout: float) -> None:
        self.weight_updater.init_broadcaster(host, port, rank_offset, inference_world_size, timeout)

    def receive_broadcast_weights(self) -> None:
        self._check_weights_awake()
        self.weight_updater.receive_broadcast()

    def weight_info(self) -> dict[str, dict[str, Any]]:
        return self.weight_updater.weight_info()


# Worker methods the engine calls in its own order (start-up, steps, the weight-update protocol, which the
# engine core wraps with its halt and weight version): refused by name from collective_rpc.
ENGINE_ONLY_METHODS = frozenset({
    "determine_num_blocks", "initialize_kv_cache", "compile_or_warm_up_model", "execute_model",
    "execute_model_async", "call", "init_weight_transfer_engine", "check_weight_transfer_init", "start_weight_update",
    "update_weights", "check_weight_update", "discard_weight_update", "finish_weight_update",
    "check_weights_from_disk", "load_weights_from_disk", "init_broadcaster", "receive_broadcast_weights"})
# What Worker.__init__ sets: an extension attribute of these names would be shadowed.
_INSTANCE_ATTRIBUTES = frozenset({"vllm_config", "model_config", "parallel_config", "rank", "local_rank", "device",
                                  "model_runner", "weight_updater", "sleeper"})


def make_worker(vllm_config: VllmConfig, rank: int = 0, local_rank: int = 0,
                distributed_init_method: str | None = None) -> Worker:
    """The worker of `rank`, with the methods of vllm_config.parallel_config.worker_extension_cls mixed in when
    set; with several ranks it joins the engine's process groups first."""
    extension = vllm_config.parallel_config.worker_extension_cls
    if not extension:
        return Worker(vllm_config, rank, local_rank, distributed_init_method)
    ext_cls = resolve_worker_extension(extension)
    clash = sorted(n for n in dir(ext_cls)
                   if not n.startswith("__") and (hasattr(Worker, n) or n in _INSTANCE_ATTRIBUTES))
    if clash:
        raise ValueError(f"worker_extension_cls {extension!r} defines {', '.join(clash)}, which the worker already "
                         "has; rename them.")
    worker_cls = type(f"Worker[{ext_cls.__name__}]", (Worker, ext_cls), {})
    return worker_cls(vllm_config, rank, local_rank, distributed_init_method)
