"""`vllm.platforms.current_platform`: the few facts about the device that RL frameworks' engine code reads
(vLLM's names): its type and torch dispatch key, whether it is CUDA, a GPU's name and UUID (IPC handles are keyed
by it), the device count, the environment variable that selects devices, the compute capability, the
distributed backend."""

from __future__ import annotations

from typing import NamedTuple

import torch


class DeviceCapability(NamedTuple):
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


class Platform:
    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    @property
    def dispatch_key(self) -> str:
        return "CUDA" if self.is_cuda() else "CPU"

    @property
    def ray_device_key(self) -> str:
        return "GPU" if self.is_cuda() else ""

    @property
    def device_control_env_var(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.is_cuda() else "gloo"

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.is_cuda()

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False

    def get_device_capability(self, device_id: int = 0) -> DeviceCapability | None:
        """(major, minor) of a CUDA device; None on CPU (vLLM's convention)."""
        if not self.is_cuda():
            return None
        return DeviceCapability(*torch.cuda.get_device_capability(device_id))

    def has_device_capability(self, capability: tuple[int, int] | int, device_id: int = 0) -> bool:
        """Whether the device's capability is at least `capability` ((9, 0) or 90)."""
        current = self.get_device_capability(device_id)
        if current is None:
            return False
        if isinstance(capability, tuple):
            return current >= capability
        return current.to_int() >= capability

    def fp8_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_cuda() else 0

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.cuda.get_device_name(device_id) if self.is_cuda() else "cpu"

    def get_device_uuid(self, device_id: int = 0) -> str:
        """The GPU's UUID as CUDA IPC handles are keyed (`str(torch.cuda.get_device_properties(i).uuid)`)."""
        if not self.is_cuda():
            raise ValueError("get_device_uuid: there is no CUDA device.")
        return str(torch.cuda.get_device_properties(device_id).uuid)


current_platform = Platform()
