"""EngineArgs: the flat list of engine options, their CLI flags, and the VllmConfig they build.

A flag's help is the docstring of the config field it sets (read from the config classes' source), so the
config classes stay the one place where an option is described; the few options that set no config field
(disable_log_stats, enable_lora, enable_log_requests) carry their docstring here, on the EngineArgs field.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
from dataclasses import dataclass, fields
from functools import cache
from typing import Any

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

_CONFIG_CLASSES = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig)
# vLLM's short forms of some flags.
_SHORT_FLAGS = {"data_parallel_size": "-dp", "tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp"}


@cache
def _field_docs() -> dict[str, str]:
    """Attribute docstrings of every config dataclass and of (Async)EngineArgs: the string literal right after
    `name: type = value`."""
    docs: dict[str, str] = {}
    for cls in (*_CONFIG_CLASSES, EngineArgs, AsyncEngineArgs):
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        for stmt, nxt in zip(body, body[1:]):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                # NOTE: the first class to describe a name wins (SchedulerConfig's internal copy of
                # max_model_len must not replace ModelConfig's description of the flag).
                docs.setdefault(stmt.target.id, " ".join(nxt.value.value.split()))
    return docs


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    return_sampling_mask: bool = False
    enforce_eager: bool = False
    cudagraph_capture_sizes: list[int] | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_batch_sharded_sampling: bool = False
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    enable_expert_parallel: bool = False
    trust_remote_code: bool = False
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    disable_log_stats: bool = False
    """Record no stats: the server's /metrics values are not updated (only vllm:num_gpu_blocks is set). The
    offline engine (LLM, LLMEngine) keeps no stats either way."""
    enable_lora: bool = False
    """Only False: LoRA adapters are not supported (merge an adapter into the weights instead)."""
    worker_extension_cls: str = ""
    weight_transfer_config: Any = None
    """How weight updates reach the engine (docs/rl.md): JSON such as '{"backend": "nccl"}' (the default), "ipc"
    (CUDA IPC handles from a process on the same GPU) or "disk" (a folder of safetensors); a dict or a
    WeightTransferConfig from Python."""
    enable_sleep_mode: bool = False
    generation_config: str = "auto"
    override_generation_config: Any = None

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, positional_model: bool = True) -> argparse.ArgumentParser:
        """One flag per field of this class (AsyncEngineArgs adds its own)."""
        docs = _field_docs()
        for f in fields(cls):
            name = "--" + f.name.replace("_", "-")
            names = (name, _SHORT_FLAGS[f.name]) if f.name in _SHORT_FLAGS else (name,)
            help_text = docs.get(f.name, "")
            if f.name == "model" and positional_model:
                parser.add_argument("model", nargs="?", default=None,
                                    help=help_text + " (also accepted as --model)")
                parser.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
                continue
            if f.type in ("bool", bool, "bool | None"):
                parser.add_argument(*names, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
                continue
            parser.add_argument(*names, type=_parse_type(str(f.type)), default=f.default, help=help_text)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        kwargs = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        if getattr(args, "model_flag", None):
            kwargs["model"] = args.model_flag
        return cls(**kwargs)

    def create_engine_config(self) -> VllmConfig:
        if self.enable_lora:
            raise ValueError("enable_lora=True is not supported: this engine has no LoRA; use enable_lora=False "
                             "(--no-enable-lora) and merge the adapter into the model's weights.")
        model_config = ModelConfig(
            model=self.model, tokenizer=self.tokenizer, served_model_name=self.served_model_name, dtype=self.dtype,
            seed=self.seed, max_model_len=self.max_model_len, skip_tokenizer_init=self.skip_tokenizer_init,
            load_format=self.load_format, logprobs_mode=self.logprobs_mode, max_logprobs=self.max_logprobs,
            return_sampling_mask=self.return_sampling_mask, enforce_eager=self.enforce_eager,
            cudagraph_capture_sizes=self.cudagraph_capture_sizes, trust_remote_code=self.trust_remote_code,
            generation_config=self.generation_config,
            override_generation_config=_json_object(self.override_generation_config, "override_generation_config"),
            enable_sleep_mode=self.enable_sleep_mode)
        return VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                                     kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                                     num_gpu_blocks_override=self.num_gpu_blocks_override,
                                     enable_prefix_caching=self.enable_prefix_caching),
            scheduler_config=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                             max_num_batched_tokens=self.max_num_batched_tokens,
                                             async_scheduling=self.async_scheduling,
                                             enable_chunked_prefill=self.enable_chunked_prefill),
            parallel_config=ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                           data_parallel_size=self.data_parallel_size,
                                           enable_batch_sharded_sampling=self.enable_batch_sharded_sampling,
                                           pipeline_parallel_size=self.pipeline_parallel_size,
                                           distributed_executor_backend=self.distributed_executor_backend,
                                           enable_expert_parallel=self.enable_expert_parallel,
                                           worker_extension_cls=self.worker_extension_cls or ""),
            device_config=DeviceConfig(device=self.device),
            weight_transfer_config=_weight_transfer_config(self.weight_transfer_config))

    def replace(self, **kwargs: Any) -> EngineArgs:
        return dataclasses.replace(self, **kwargs)


@dataclass
class AsyncEngineArgs(EngineArgs):
    """EngineArgs of AsyncLLM (and `vllm serve`)."""

    enable_log_requests: bool = False
    """Log each request as it is added (its id, prompt length and sampling params) at INFO."""


def _weight_transfer_config(value: Any) -> Any:
    if value is None:
        return None
    from vllm.config.weight_transfer import WeightTransferConfig
    return WeightTransferConfig.parse(value)


def _json_object(value: Any, name: str) -> dict[str, Any] | None:
    """A dict, or its JSON text (the CLI's form), or None."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except ValueError as e:
        raise ValueError(f"{name} must be a JSON object, got {value!r}: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}.")
    return parsed


def _parse_int_list(value: str) -> list[int]:
    try:
        return [int(v) for v in value.replace(" ", "").split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None


def _parse_type(annotation: str) -> Any:
    base = annotation.replace(" | None", "").strip()
    return {"int": int, "float": float, "str": str, "list[int]": _parse_int_list}.get(base, str)
