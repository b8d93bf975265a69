"""ModelConfig: which checkpoint, in which dtype, and how its outputs are returned."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
LOAD_FORMATS = ("auto", "safetensors", "dummy")

_STR_TO_DTYPE = {
    "float32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


DEFAULT_MODEL_NAME = "tiny-llama"
"""The served name of the bundled model (its folder's name), whichever checkout or install it runs from."""


def default_model_path() -> str:
    """The bundled tiny model: the default whenever no model is named."""
    return os.path.join(os.path.dirname(os.path.dirname(__file__)), "assets", DEFAULT_MODEL_NAME)


def load_hf_config(model: str) -> SimpleNamespace:
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"No config.json in {model!r}: the model must be a local folder in Hugging Face format "
                         "(there is no model hub at run time).")
    with open(path) as f:
        raw: dict[str, Any] = json.load(f)
    return SimpleNamespace(**raw)


@dataclass
class ModelConfig:
    model: str | None = None
    """Path of a local Hugging Face checkpoint folder; the bundled tiny model when not given."""
    tokenizer: str | None = None
    """Tokenizer folder; the model folder when not given."""
    served_model_name: str | None = None
    """Model name reported by the API (and required in requests' `model`); when not given, the model as given
    (vLLM's rule), or tiny-llama for the bundled model."""
    dtype: str | torch.dtype = "auto"
    """Weights and activations dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, float16, bfloat16. Once
    the engine's config is built (VllmConfig), the torch dtype it resolved to, as in vLLM."""
    seed: int = 0
    """Seed of the engine's random state (requests without their own seed)."""
    max_model_len: int | None = None
    """Context length (prompt plus output); the model's max_position_embeddings when not given."""
    skip_tokenizer_init: bool = False
    """Do not load a tokenizer: prompts must be token ids and outputs carry no text."""
    load_format: str = "auto"
    """auto or safetensors: read the checkpoint's weights; dummy: random weights from config.json alone."""
    logprobs_mode: str = "raw_logprobs"
    """What `logprobs` returns: raw_logprobs, raw_logits, processed_logprobs or processed_logits."""
    max_logprobs: int = 20
    """Largest `logprobs` a request may ask for."""
    return_sampling_mask: bool = False
    """Return, for every generated token, the ids the sampler could have drawn (its support). Needs
    --logprobs-mode processed_logprobs."""
    sampling_mask_text: bool = False
    """Internal, set by the API server: the engine also returns each token's
    sampling mask as JSON text, formatted on the device, so that the server does not turn hundreds of ids per
    token into Python ints."""

    enforce_eager: bool = False
    """Always run the model eagerly: no CUDA graphs for decode or mixed steps (CPU never uses them)."""
    cudagraph_capture_sizes: list[int] | None = None
    """Decode batch sizes captured as CUDA graphs (a batch replays the smallest size that holds it; steps with
    prefills sample as the sampler graph of the size that holds their requests); the default is 1, 2, 4, 8, 16,
    24, ..., 1024, capped at max_num_seqs and max_num_batched_tokens. Comma-separated."""
    trust_remote_code: bool = False
    """Accepted for vLLM compatibility; no effect: only the built-in architectures (Llama, Qwen2, Qwen3) load,
    and no code from a checkpoint folder ever runs."""
    enable_sleep_mode: bool = False
    """Sleep mode for colocated training (docs/rl.md): `sleep(level)` hands the weights' and the KV cache's
    device memory back and `wake_up(tags)` takes it again at the same addresses (CUDA graphs stay valid)."""

    generation_config: str = "auto"
    """Where requests' default sampling values come from: auto (the model folder's generation_config.json), vllm
    (none: vLLM's neutral defaults) or a folder holding a generation_config.json. Applies temperature, top_p,
    top_k, min_p, repetition_penalty and max_new_tokens to requests that leave them unset."""
    override_generation_config: dict[str, Any] | None = None
    """A JSON object merged over the generation config (also with --generation-config vllm), e.g.
    '{"temperature": 0.5}'."""

    hf_config: SimpleNamespace = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.served_model_name is None:
            # NOTE: the name the user gave, not the folder it resolves to (no absolute path of this checkout).
            self.served_model_name = DEFAULT_MODEL_NAME if self.model is None else self.model
        if self.model is None:
            self.model = default_model_path()
        self.model = os.path.expanduser(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs_mode!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if self.dtype != "auto" and self.dtype not in _STR_TO_DTYPE and self.dtype not in _STR_TO_DTYPE.values():
            raise ValueError(f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}.")
        if self.cudagraph_capture_sizes is not None and any(s < 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes must be positive, got {self.cudagraph_capture_sizes}.")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be non-negative, got {self.max_logprobs}.")
        self.hf_config = load_hf_config(self.model)
        archs = getattr(self.hf_config, "architectures", None) or []
        if not archs:
            raise ValueError(f"config.json of {self.model!r} names no architectures.")
        max_pos = int(getattr(self.hf_config, "max_position_embeddings", 2048))
        if self.max_model_len is None:
            self.max_model_len = max_pos
        elif self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}.")
        elif self.max_model_len > max_pos:
            raise ValueError(f"max_model_len={self.max_model_len} is larger than the model's "
                             f"max_position_embeddings={max_pos}; lower max_model_len.")

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """The generation config's sampling defaults under vLLM's names (vllm/config/generation_config.py)."""
        from vllm.config.generation_config import diff_sampling_param
        return diff_sampling_param(str(self.model), self.generation_config, self.override_generation_config)

    @property
    def architectures(self) -> list[str]:
        return list(self.hf_config.architectures)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def name(self) -> str:
        return self.served_model_name or str(self.model)

    @property
    def sampling_mask_mode(self) -> str:
        """off; ids (--return-sampling-mask); ids+text (and each mask as JSON text, formatted on the device: the
        API server's mode)."""
        if not self.return_sampling_mask:
            return "off"
        return "ids+text" if self.sampling_mask_text else "ids"

    def describe(self, device: torch.device, dtype: torch.dtype) -> str:
        """One line for the start-up log: what runs, where, in which dtype, with which outputs."""
        return (f"model {self.name} ({', '.join(self.architectures)} from {self.model}) on {device}, dtype "
                f"{str(dtype).removeprefix('torch.')}, sampling mask {self.sampling_mask_mode}, logprobs mode "
                f"{self.logprobs_mode}")

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype != "auto":
            return _STR_TO_DTYPE[self.dtype]
        if device.type == "cpu":
            return torch.float32
        cfg = str(getattr(self.hf_config, "torch_dtype", None) or getattr(self.hf_config, "dtype", "bfloat16"))
        return torch.float16 if cfg == "float16" else torch.bfloat16

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)

    @property
    def num_kv_heads(self) -> int:
        """The model's KV heads (all ranks together)."""
        cfg = self.hf_config
        return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)

    def get_num_kv_heads(self, parallel_config: Any) -> int:
        """KV heads on one tensor-parallel rank (what its KV cache holds): at least one, replicated when the
        model has fewer KV heads than ranks (vLLM's rule)."""
        return max(1, self.num_kv_heads // parallel_config.tensor_parallel_size)

    def get_num_attention_heads(self, parallel_config: Any) -> int:
        """Query heads on one tensor-parallel rank."""
        return int(self.hf_config.num_attention_heads) // parallel_config.tensor_parallel_size

    def verify_with_parallel_config(self, parallel_config: Any) -> None:
        """ValueError when the model cannot be split over tensor_parallel_size ranks: the query heads, the KV heads
        (or the ranks over them), the MLP's intermediate size and the vocabulary padded to 64 must divide."""
        tp = int(parallel_config.tensor_parallel_size)
        if tp == 1:
            return
        cfg = self.hf_config
        num_heads, num_kv_heads = int(cfg.num_attention_heads), self.num_kv_heads
        problems = []
        if num_heads % tp:
            problems.append(f"num_attention_heads={num_heads} is not divisible by it")
        if (num_kv_heads % tp) if num_kv_heads >= tp else (tp % num_kv_heads):
            problems.append(f"num_key_value_heads={num_kv_heads} neither divides it nor is a multiple of it")
        intermediate = int(getattr(cfg, "intermediate_size", 0) or 0)
        if intermediate % tp:
            problems.append(f"intermediate_size={intermediate} is not divisible by it")
        padded_vocab = -(-self.vocab_size // 64) * 64
        if padded_vocab % tp:
            problems.append(f"the vocabulary padded to a multiple of 64 ({padded_vocab}) is not divisible by it")
        if problems:
            raise ValueError(f"tensor_parallel_size={tp} cannot split {self.name}: " + "; ".join(problems) + ".")

    @property
    def head_size(self) -> int:
        cfg = self.hf_config
        return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
