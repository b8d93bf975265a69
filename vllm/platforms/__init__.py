"""`vllm.platforms.current_platform`: the few facts about the device that RL frameworks' engine code reads
(vLLM's names): its type and torch dispatch key, whether it is CUDA, a GPU's name and UUID (IPC handles are keyed
by it), the device count."""

from __future__ import annotations

import torch


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

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_rocm(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.is_cuda()

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
