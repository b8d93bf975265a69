"""Second checkpoints of the bundled model for the weight-update tests: the same config and tokenizer, other
weights (a fixed perturbation), written as one safetensors file or as shards with an index; and trainer-side
senders that tests run in a spawned process (here, so that the child imports no test module)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vllm.config.model import default_model_path


def bundled_weights() -> dict[str, torch.Tensor]:
    return load_file(str(Path(default_model_path()) / "model.safetensors"))


def perturbed_weights(seed: int = 1, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """Every weight plus noise of `scale` times its own standard deviation (norm weights too)."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in sorted(bundled_weights().items()):
        noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
        std = float(tensor.float().std()) if tensor.numel() > 1 else 1.0
        out[name] = (tensor.float() + scale * std * noise).to(tensor.dtype)
    return out


def write_checkpoint(folder: Path, weights: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """A model folder (the bundled config and tokenizer) with `weights`, in `shards` files (an index if > 1)."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in Path(default_model_path()).iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, folder / path.name)
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n].contiguous() for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: weights[n].contiguous() for n in part}, str(folder / file_name))
        weight_map.update({n: file_name for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def prime_rl_broadcaster(port: int, rounds: list[str]) -> None:
    """prime-rl's trainer side: rank 0 of a StatelessProcessGroup + PyNcclCommunicator (gloo on CPU), one update
    per round, one state dict per layer (and one for the rest), as its broadcaster sends them."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.distributed.weight_transfer.broadcast_receiver import send_state_dicts
    group = StatelessProcessGroup.create("127.0.0.1", port, rank=0, world_size=2, store_timeout=60)
    communicator = PyNcclCommunicator(group, device="cpu")
    for which in rounds:
        weights = perturbed_weights() if which == "new" else bundled_weights()
        if which == "bad":
            weights = {"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 3)}
        layers: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights.items():
            layers.setdefault(name.split(".")[2] if ".layers." in name else "rest", {})[name] = tensor
        send_state_dicts(communicator, list(layers.values()))
