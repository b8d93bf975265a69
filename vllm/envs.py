"""Every VLLM_* environment variable, typed, in one place.

Only vLLM's own variables, each read where its feature starts (engine or server start-up, request validation),
never in the per-step loop; experiment switches are not kept here (decide, keep the winner: docs/benchmarks.md).
"""

from __future__ import annotations

import os


def _str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value else default


def _bool(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    return value.strip().lower() in ("1", "true", "yes", "on")


def _int(name: str, default: int) -> int:
    value = _str(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def __getattr__(name: str):  # read at use, so tests can set variables with monkeypatch
    if name in _VARS:
        return _VARS[name]()
    raise AttributeError(name)


_VARS = {
    # Attention backend: TORCH or TRITON (default: TRITON on CUDA, TORCH on CPU).
    "VLLM_ATTENTION_BACKEND": lambda: _str("VLLM_ATTENTION_BACKEND"),
    # Run the engine core in a child process (1) or in the caller's process (0); LLM defaults to in-process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": lambda: _bool("VLLM_ENABLE_V1_MULTIPROCESSING", False),
    # vLLM's: mount the server's admin endpoints (pause/resume, weight updates, collective_rpc: docs/rl.md); they
    # load files and run worker methods by name, so only on a trusted network. `--enable-rl-endpoints` does too.
    "VLLM_SERVER_DEV_MODE": lambda: _bool("VLLM_SERVER_DEV_MODE", False),
    # CPU KV cache size in GiB when kv_cache_memory_bytes is not given.
    "VLLM_CPU_KVCACHE_SPACE": lambda: float(_str("VLLM_CPU_KVCACHE_SPACE", "1") or 1),
    # The largest `n` (samples per prompt) a request may ask for, as vLLM (and, for a completion with several
    # prompts, n x the number of prompts); a request over it is refused before any work (HTTP 400).
    "VLLM_MAX_N_SEQUENCES": lambda: _int("VLLM_MAX_N_SEQUENCES", 16384),
}
