"""CUDA events that a host thread waits on.

CUDA's default event spin-waits in `synchronize()`, keeping the async output thread's core busy while it waits;
a blocking-sync event (the thread sleeps in the driver) was never measured to help, so the default stays.
"""

from __future__ import annotations

import torch


def host_event() -> torch.cuda.Event:
    """A new CUDA event that the host will `synchronize()` on."""
    return torch.cuda.Event()
