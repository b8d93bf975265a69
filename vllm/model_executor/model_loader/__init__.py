"""Builds the model of a ModelConfig on a device and fills its weights.

load_format "auto"/"safetensors" reads model.safetensors, or every shard named by model.safetensors.index.json,
and hands the tensors to the model's `load_weights`; every parameter must end up loaded, else ValueError.
"dummy" needs only config.json: every weight uniform in [-1e-3, 1e-3] from a generator seeded with the
config's seed (so two loads are identical) and every RMSNorm weight 1, so activations stay well scaled.

Under tensor parallelism each rank builds only its shard of every layer (the layers read the group), and the
loaders cut its part from the whole checkpoint tensors. Dummy weights are drawn whole (the one-rank shape, in
the same order) and cut the same way, so the shards of a TP=N dummy model are the slices of the TP=1 dummy model
(each rank draws every tensor whole once: the cost of one full random init, and one tensor at a time in memory).
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from safetensors import safe_open
from torch import nn

from vllm.config.model import ModelConfig
from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.registry import get_model_class
from vllm.model_executor.utils import full_shape, load_full_parameter

logger = logging.getLogger(__name__)

DUMMY_WEIGHT_RANGE = 1e-3


@contextmanager
def set_default_torch_dtype(dtype: torch.dtype) -> Iterator[None]:
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old_dtype)


def get_safetensors_files(model_dir: str) -> list[str]:
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"No .safetensors weights in {model_dir!r} (use load_format='dummy' for random weights).")
    return files


def safetensors_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int, low: float = -DUMMY_WEIGHT_RANGE,
                             high: float = DUMMY_WEIGHT_RANGE) -> None:
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    generators: dict[torch.device, torch.Generator] = {}
    whole = get_tensor_model_parallel_world_size() == 1
    for _, param in model.named_parameters():
        if id(param) in norm_weights:
            param.fill_(1.0)
            continue
        generator = generators.get(param.device)
        if generator is None:
            generator = generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        if not param.dtype.is_floating_point:
            continue
        if whole:
            param.uniform_(low, high, generator=generator)
        else:
            full = torch.empty(full_shape(param), dtype=param.dtype, device=param.device)
            load_full_parameter(param, full.uniform_(low, high, generator=generator))


@torch.no_grad()
def get_model(model_config: ModelConfig, device: torch.device, dtype: torch.dtype) -> nn.Module:
    model_cls = get_model_class(model_config.architectures)
    logger.info("Loading %s", model_config.describe(device, dtype))
    with set_default_torch_dtype(dtype), torch.device(device):
        model = model_cls(model_config.hf_config)
    if model_config.load_format == "dummy":
        initialize_dummy_weights(model, model_config.seed)
    else:
        assert model_config.model is not None
        files = get_safetensors_files(model_config.model)
        loaded = model.load_weights(safetensors_weights_iterator(files))  # type: ignore[operator]
        missing = sorted(set(name for name, _ in model.named_parameters()) - loaded)
        if missing:
            raise ValueError(f"Weights missing from the checkpoint in {model_config.model!r}: {', '.join(missing)}")
    return model.eval()
