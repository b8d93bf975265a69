"""CUDA events that a host thread waits on.

CUDA's default event spin-waits in `synchronize()`: the async output thread then keeps a CPU core busy for most of
every step (58-78% of a core in the 2026-12-03 serving runs). VLLM_OUTPUT_BLOCKING_SYNC=1 (an experiment switch,
off by default; docs/benchmarks.md) makes these events blocking-sync ones: the waiting thread sleeps in the driver
until the event fires, at the cost of a wake-up latency.
"""

from __future__ import annotations

import torch

from vllm import envs


def host_event() -> torch.cuda.Event:
    """A new CUDA event that the host will `synchronize()` on (blocking-sync with VLLM_OUTPUT_BLOCKING_SYNC=1)."""
    return torch.cuda.Event(blocking=envs.VLLM_OUTPUT_BLOCKING_SYNC)
