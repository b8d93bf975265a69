"""Small helpers with vLLM's names (kept free of torch, so `import vllm.utils` stays light)."""

from __future__ import annotations

import logging
import uuid

_warned: set[tuple[str, str]] = set()


def random_uuid() -> str:
    """A fresh random id: 32 lowercase hex digits (what vLLM's request ids are made of)."""
    return uuid.uuid4().hex


def warning_once(logger: logging.Logger, message: str) -> None:
    """Log `message` at WARNING the first time this logger is given it in this process, then never again
    (configs are built more than once per engine, e.g. by `vllm serve`'s flag check and by the server)."""
    key = (logger.name, message)
    if key not in _warned:
        _warned.add(key)
        logger.warning(message)
