"""Every VLLM_* environment variable, typed, in one place."""

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


def _float(name: str) -> float | None:
    value = _str(name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {value!r}") from None


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
    # Benchmarks only: run the pre-change sampling-mask path (copy the full bitmask every step, unpack on host).
    "VLLM_SAMPLING_MASK_LEGACY_PATH": lambda: _bool("VLLM_SAMPLING_MASK_LEGACY_PATH", False),
    # Serving: format the sampling masks' JSON text on the device and splice it into streamed chunks
    # (vllm/v1/sample/ops/mask_json.py); 0 makes the API server format the ids itself (docs/benchmarks.md).
    "VLLM_SAMPLING_MASK_TEXT": lambda: _bool("VLLM_SAMPLING_MASK_TEXT", True),
    # Performance work only: with that text on, the engine core copies the masks' text and counts to the host, not
    # their ids, which the API servers never receive (0, the default); 1 copies the ids too, as before
    # (vllm/v1/worker/async_output.py; measured in docs/benchmarks.md).
    "VLLM_SAMPLING_MASK_COPY_IDS": lambda: _bool("VLLM_SAMPLING_MASK_COPY_IDS", False),
    # Performance work only: cProfile the API server and engine-core processes into this folder (vllm/profiling.py).
    "VLLM_CPROFILE_DIR": lambda: _str("VLLM_CPROFILE_DIR"),
    # Performance work only: the engine-core process logs where its time goes per step every 5 s
    # (vllm/v1/metrics/step_timing.py), and each API server its garbage-collection pauses (gc_timing.py).
    "VLLM_ENGINE_STEP_TIMING": lambda: _bool("VLLM_ENGINE_STEP_TIMING", False),
    # Capture the LM head + sampler of graphed decode steps as CUDA graphs (vllm/v1/worker/cudagraph.py); 0 runs
    # them eagerly (for comparisons).
    "VLLM_SAMPLER_CUDA_GRAPH": lambda: _bool("VLLM_SAMPLER_CUDA_GRAPH", True),
    # Capture mixed prefill+decode steps as CUDA graphs, padded to fixed token counts (vllm/v1/worker/cudagraph.py;
    # CUDA graphs on and the Triton backend only); 0 runs them eagerly (measured in docs/benchmarks.md).
    "VLLM_MIXED_CUDA_GRAPH": lambda: _bool("VLLM_MIXED_CUDA_GRAPH", True),
    # Steps with prefills run their logits + sampler as the sampler CUDA graph of their padded request count, over
    # the requests' last hidden states (vllm/v1/worker/model_runner.py); 0 samples them eagerly.
    "VLLM_SAMPLER_GRAPH_MIXED": lambda: _bool("VLLM_SAMPLER_GRAPH_MIXED", True),
    # Performance work only: the engine-core process's GIL switch interval in ms (sys.setswitchinterval; unset:
    # Python's 5 ms). Its main thread shares the GIL with the output thread (docs/benchmarks.md).
    "VLLM_ENGINE_GIL_SWITCH_INTERVAL_MS": lambda: _float("VLLM_ENGINE_GIL_SWITCH_INTERVAL_MS"),
    # Performance work only: the engine-core process sends its output frames copied (1) instead of zero-copy (the
    # default, whose large frames pyzmq releases from a thread of its own that takes the GIL; docs/benchmarks.md).
    "VLLM_ENGINE_SEND_COPY": lambda: _bool("VLLM_ENGINE_SEND_COPY", False),
    # Performance work only: the engine core schedules and launches the step after next before it sends (or, in
    # process, hands on) the outputs of the step just finished (EngineCore.launch_ahead).
    "VLLM_ENGINE_LAUNCH_AHEAD": lambda: _bool("VLLM_ENGINE_LAUNCH_AHEAD", False),
    # A step's sampling-mask lists are built by the engine core's main thread when the step's outputs are sent
    # (after the next launch with VLLM_ENGINE_LAUNCH_AHEAD), not by the output thread before the step's update
    # (vllm/v1/worker/async_output.py: DeferredMasks); on by default since the ninth session's H200 A/B (the two
    # threads no longer take turns on the GIL while the next step launches; docs/benchmarks.md). 0: the output
    # thread builds them.
    "VLLM_ENGINE_DEFER_MASK_LISTS": lambda: _bool("VLLM_ENGINE_DEFER_MASK_LISTS", True),
    # Performance work only: the CUDA events the engine's threads wait on sleep instead of spinning
    # (vllm/v1/cuda_events.py).
    "VLLM_OUTPUT_BLOCKING_SYNC": lambda: _bool("VLLM_OUTPUT_BLOCKING_SYNC", False),
    # Performance work only: the sampler's top-k select on CUDA tensors, "prefilter" (the default), "topk" or
    # "row" (vllm/v1/sample/ops/topk_select.py; the same outputs bit for bit, measured in docs/benchmarks.md).
    "VLLM_TOPK_SELECT_IMPL": lambda: _str("VLLM_TOPK_SELECT_IMPL"),
    # CPU KV cache size in GiB when kv_cache_memory_bytes is not given.
    # vLLM's: mount the server's admin endpoints (pause/resume, weight updates, collective_rpc: docs/rl.md); they
    # load files and run worker methods by name, so only on a trusted network. `--enable-rl-endpoints` does too.
    "VLLM_SERVER_DEV_MODE": lambda: _bool("VLLM_SERVER_DEV_MODE", False),
    "VLLM_CPU_KVCACHE_SPACE": lambda: float(_str("VLLM_CPU_KVCACHE_SPACE", "1") or 1),
    # The largest `n` (samples per prompt) a request may ask for, as vLLM (and, for a completion with several
    # prompts, n x the number of prompts); a request over it is refused before any work (HTTP 400).
    "VLLM_MAX_N_SEQUENCES": lambda: _int("VLLM_MAX_N_SEQUENCES", 16384),
}
