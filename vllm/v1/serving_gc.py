"""The cyclic garbage collector's policy of a serving process (API server, engine core).

Role: `freeze_startup_heap()` runs once a process has built everything that lives as long as it does (imports,
model, CUDA graphs, app): a full collection, `gc.freeze()` (those objects move to a permanent generation that no
later collection walks), then SERVING_GC_THRESHOLDS. At exit they are unfrozen again (an atexit hook), so the
interpreter's final collections free them as they free everything else. `serving_thresholds()` applies only the
thresholds, for a block, in a process that is not the engine's own (LLM.generate).

Why: serving allocates thousands of short-lived objects per engine step (outputs, lists, chunks, frames), nearly
all freed by reference counting. With Python's default thresholds (700, 10, 10) the collector ran a young
collection every few hundred microseconds and a full one several times a second; a full collection walks every
live request's objects. Measured on the H200 (a GC log since removed): the API servers paused 16-27%
of the time at 1024 streams before they took these thresholds, and the engine core, still on the defaults,
10-12 full collections per 5 s at ~1000 rows of 12-25 ms each (longer than a decode step: the device idles),
4.6-7.2% of the time paused (2026-12-03; the record is in the history of docs/benchmarks.md).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator

# Young collections 10x rarer than Python's default (700), full ones after 20 older ones instead of 10 (and, as
# always, only once the long-lived objects grew by 25%).
SERVING_GC_THRESHOLDS = (7000, 10, 20)


def freeze_startup_heap() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
    # NOTE: frozen objects are never collected, not even at exit: the triton objects among them (nanobind
    # instances of libtriton) outlived triton's own teardown, and nanobind printed ~30 lines of "nanobind: leaked
    # ..." on every exit of a server or engine-core process. Unfrozen, they are freed in order.
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


@contextlib.contextmanager
def serving_thresholds() -> Iterator[None]:
    """SERVING_GC_THRESHOLDS while the block runs (each at least the caller's; nothing when the caller turned
    automatic collection off), the caller's thresholds again after (nothing frozen): for an engine stepped in
    someone else's process (LLM.generate), whose heap is theirs.

    NOTE: offline `LLM.generate` of 1024 requests on the development machine (tools/profiling/offline_host.py,
    no device): 15.2 -> 8.1 ms of host work per step without masks, 22.0 -> 10.0 with them, on Python's default
    thresholds -> these; 1118 young and 7 full collections -> 64 and none (each full one walked every request's
    logprob dicts, ~0.2 s)."""
    before = gc.get_threshold()
    # NOTE: never lower what the caller set, nor turn on a collector they turned off (threshold 0).
    if before[0] != 0:
        gc.set_threshold(*(max(b, s) for b, s in zip(before, SERVING_GC_THRESHOLDS)))
    try:
        yield
    finally:
        gc.set_threshold(*before)
