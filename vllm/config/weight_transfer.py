"""WeightTransferConfig: which transport carries a trainer's new weights into the running engine.

vLLM's `--weight-transfer-config '{"backend": "nccl"}'` and `LLM(weight_transfer_config=...)`. The backend is
chosen once per engine; the rendezvous details (addresses, ports, paths) arrive later, from the trainer, in
`init_info` and `update_info` (see vllm/distributed/weight_transfer/).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "disk")


@dataclass(frozen=True)
class WeightTransferConfig:
    backend: Literal["nccl", "ipc", "disk"] = "nccl"
    """nccl: the trainer broadcasts over a process group it shares with the workers (NCCL on CUDA, gloo on
    CPU); ipc: a trainer on the same GPU hands over CUDA IPC handles; disk: the engine reads a safetensors
    folder the trainer wrote."""

    def __post_init__(self) -> None:
        if self.backend not in WEIGHT_TRANSFER_BACKENDS:
            raise ValueError(f"weight transfer backend must be one of {', '.join(WEIGHT_TRANSFER_BACKENDS)}; "
                             f"got {self.backend!r}.")

    @classmethod
    def parse(cls, value: WeightTransferConfig | dict[str, Any] | str) -> WeightTransferConfig:
        """Build from the CLI's JSON string, a dict (`LLM(weight_transfer_config={...})`) or an instance."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"weight transfer config is not valid JSON ({e.msg}): {value!r}.") from None
        if not isinstance(value, dict):
            raise ValueError("weight transfer config must be a JSON object such as '{\"backend\": \"nccl\"}'; "
                             f"got {value!r}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(str(k) for k in value if k not in known)
        if unknown:
            raise ValueError(f"unknown weight transfer config key(s) {unknown}; the known keys are {sorted(known)}.")
        return cls(**value)
