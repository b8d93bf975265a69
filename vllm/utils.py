"""Small helpers with vLLM's names (kept free of torch, so `import vllm.utils` stays light)."""

from __future__ import annotations

import logging
import socket
import uuid

_warned: set[tuple[str, str]] = set()


def random_uuid() -> str:
    """A fresh random id: 32 lowercase hex digits (what vLLM's request ids are made of)."""
    return uuid.uuid4().hex


def refuse_lora_request(lora_request: object) -> None:
    """vLLM's `lora_request` argument: only None (this engine has no LoRA)."""
    if lora_request is not None:
        raise ValueError("lora_request is not supported: this engine has no LoRA; pass lora_request=None.")


def refuse_stat_loggers(stat_loggers: object) -> None:
    """vLLM's `stat_loggers` argument of the engines' constructors: only None."""
    if stat_loggers is not None:
        raise ValueError("stat_loggers is not supported: custom stat loggers cannot be added (the engine's "
                         "metrics are Prometheus ones, served at /metrics); pass stat_loggers=None.")


def warning_once(logger: logging.Logger, message: str) -> None:
    """Log `message` at WARNING the first time this logger is given it in this process, then never again
    (configs are built more than once per engine, e.g. by `vllm serve`'s flag check and by the server)."""
    key = (logger.name, message)
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)


def unwrap_info(value: object, key: str) -> dict:
    """The info dict of a weight-transfer call: given as is, as `{key: info}` (the HTTP body), or as an object
    with a `key` attribute (vLLM's request dataclasses)."""
    if isinstance(value, dict) and set(value) == {key}:
        value = value[key]
    elif not isinstance(value, dict) and hasattr(value, key):
        value = getattr(value, key)
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be an object (a dict), got {type(value).__name__}.")
    return value


def get_open_port() -> int:
    """A TCP port free on this host now (vLLM's helper): for a torch.distributed init method or a store."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
