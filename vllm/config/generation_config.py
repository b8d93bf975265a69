"""The model creator's sampling defaults (generation_config.json) that requests leaving a field unset get.

vLLM's rule (`ModelConfig.get_diff_sampling_param`), with its flag `--generation-config`:
- `auto` (the default) reads `generation_config.json` of the model folder; `vllm` reads nothing (vLLM's neutral
  defaults); any other value is a folder whose `generation_config.json` is read.
- Of that file, only `repetition_penalty`, `temperature`, `top_k`, `top_p`, `min_p` and `max_new_tokens` are
  used, those present and not null (transformers 5 writes only the values a creator set), `max_new_tokens` under
  vLLM's name `max_tokens`. `--override-generation-config` (a JSON object) is merged over the file first, also
  with `--generation-config vllm`.
- The result (the "diff") is what callers apply: the server to each request field left unset (a value the
  request sends wins; `max_tokens` is the smaller of the two), `LLM.get_default_sampling_params()` when
  `generate` / `chat` get no SamplingParams. A folder without the file gives no defaults.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_SAMPLING_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def read_generation_config(folder: str) -> dict[str, Any]:
    """`generation_config.json` of `folder` as a dict ({} when there is none)."""
    path = os.path.join(os.path.expanduser(folder), "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data


def diff_sampling_param(model: str, generation_config: str, override: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling defaults under vLLM's names (module docstring)."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        config = read_generation_config(model)
    else:
        if not os.path.isdir(os.path.expanduser(generation_config)):
            raise ValueError(f"--generation-config must be auto, vllm or a folder holding generation_config.json; "
                             f"{generation_config!r} is not a folder.")
        config = read_generation_config(generation_config)
    config = {**config, **(override or {})}
    diff = {key: config[key] for key in GENERATION_CONFIG_SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in diff:
        diff["max_tokens"] = diff.pop("max_new_tokens")
    if diff:
        logger.warning("Default sampling parameters have been overridden by the model's generation config (%s). "
                       "If this is not intended, relaunch with `--generation-config vllm`.",
                       ", ".join(f"{k}={v!r}" for k, v in diff.items()))
    return diff
