"""A worker extension for the RL lifecycle tests (imported by name, as frameworks pass worker_extension_cls)."""

from __future__ import annotations

import time
from typing import Any

import torch


class ProbeExtension:
    """Reads the worker attributes RL frameworks' extensions read, and changes one weight as they do."""

    def probe_report(self) -> dict[str, Any]:
        model = self.model_runner.model  # type: ignore[attr-defined]
        worker: Any = self
        return {"device": str(worker.device), "rank": worker.rank, "local_rank": worker.local_rank,
                "dtype": str(self.model_config.dtype),  # type: ignore[attr-defined]
                "num_params": sum(1 for _ in model.named_parameters())}

    def probe_load(self, name: str, value: float) -> float:
        """Fill one checkpoint tensor through the model's load_weights (the frameworks' call), return its sum."""
        model = self.model_runner.model  # type: ignore[attr-defined]
        shape = model.checkpoint_weight_shape(name)
        model.load_weights(weights=[(name, torch.full(shape, value))])
        return float(dict(model.named_parameters())[name].sum())


    def probe_dist(self) -> list[Any]:
        """What OpenRLHF-style extensions read first: the default process group and this worker's rank in it."""
        import torch.distributed as dist
        return [dist.is_initialized(), dist.get_rank(), dist.get_world_size()]

    def probe_pid(self) -> int:
        """This rank's process id (the tensor-parallel tests kill a worker by it)."""
        import os
        return os.getpid()

    def probe_parallel(self) -> list[int]:
        """The data-parallel rank and size of this worker's engine core (the config copy its launcher gave it)."""
        parallel = self.parallel_config  # type: ignore[attr-defined]
        return [parallel.data_parallel_rank, parallel.data_parallel_size]

    def probe_sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def probe_tick(self) -> list[int]:
        """Counts this worker's calls: [its engine's data-parallel rank, how many times it ran probe_tick]."""
        self.probe_ticks = getattr(self, "probe_ticks", 0) + 1
        return [self.parallel_config.data_parallel_rank, self.probe_ticks]  # type: ignore[attr-defined]


class ClashingExtension:
    def update_weights(self, update_info: Any) -> None:  # the worker has one
        pass


class FrameworkStyleExtension:
    """Loads weights the way verl's, OpenRLHF's and NeMo-RL's extensions do, through the vLLM names they import."""

    def fw_load_checkpoint(self, folder: str) -> str:
        from safetensors.torch import load_file

        from vllm.config import get_current_vllm_config, set_current_vllm_config
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.platforms import current_platform
        worker: Any = self
        weights = load_file(f"{folder}/model.safetensors")
        with set_current_vllm_config(worker.vllm_config):
            assert get_current_vllm_config() is worker.vllm_config
            worker.model_runner.model.load_weights(weights=list(weights.items()))
        process_weights_after_loading(worker.model_runner.model, worker.model_config, worker.device)
        return current_platform.device_type


# Callables for collective_rpc across processes: sent by reference (pickle), so they live in an importable module.

def rank_and_double(worker: Any, x: int) -> tuple[int, int]:
    return worker.rank, 2 * x


def worker_rank(worker: Any) -> int:
    return worker.rank


def param_sum(worker: Any, name: str) -> float:
    return float(dict(worker.model_runner.model.named_parameters())[name].double().sum())


def unpicklable_result(worker: Any) -> Any:
    import threading
    return threading.Lock()


def worker_pid(worker: Any) -> int:
    import os
    return os.getpid()


def dp_and_tp_rank(worker: Any) -> list[int]:
    return [worker.parallel_config.data_parallel_rank, worker.rank]


class TwoArgError(Exception):
    """Pickles but does not unpickle (pickle calls TwoArgError(message)): its __init__ takes two arguments."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a}-{b}")


def raise_two_arg_error_on_rank1(worker: Any) -> int:
    if worker.rank == 1:
        raise TwoArgError("left", "right")
    return worker.rank


def refuse_disk_check_on_rank1(worker: Any) -> int:
    """Rank 1 alone refuses a disk update at its check (a checkpoint that one node cannot read)."""
    if worker.rank == 1:
        def refuse(path: str) -> None:
            raise ValueError("Weight update refused, no weight was changed: (test: unreadable on this node)")
        worker.weight_updater.check_disk = refuse
    return worker.rank


def restore_disk_check(worker: Any) -> None:
    worker.weight_updater.__dict__.pop("check_disk", None)


def refuse_update_check_on_rank1(worker: Any) -> int:
    """Rank 1 alone refuses every update_weights at its check (its model differs, as a rank's could)."""
    if worker.rank == 1:
        def refuse(names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]]) -> None:
            raise ValueError("Weight update refused, no weight was changed: (test: rank 1 refuses)")
        worker.weight_updater.check = refuse
    return worker.rank


def refuse_update_check(worker: Any) -> None:
    """This worker refuses every update_weights at its check (sent to one data-parallel engine by name)."""
    def refuse(names: list[str], dtype_names: list[str], shapes: list[tuple[int, ...]]) -> None:
        raise ValueError("Weight update refused, no weight was changed: (test: this engine refuses)")
    worker.weight_updater.check = refuse


def restore_update_check(worker: Any) -> None:
    worker.weight_updater.__dict__.pop("check", None)


def break_disk_load_on_rank1(worker: Any) -> int:
    """Rank 1 alone fails its disk load after every rank's check passed (rank 0 loads)."""
    if worker.rank == 1:
        def fail(path: str) -> None:
            raise RuntimeError("The weight transfer failed midway (test: the disk went away on this node)")
        worker.weight_updater.load_from_disk = fail
    return worker.rank


def batch_token_ids(worker: Any) -> dict[str, list[int]]:
    """Each live request's token ids (prompt + sampled) as this rank's input batch holds them."""
    batch = worker.model_runner.input_batch
    return {req_id: batch.token_ids_cpu[row, :batch.num_tokens[row]].tolist()
            for row, req_id in enumerate(batch.req_ids)}
