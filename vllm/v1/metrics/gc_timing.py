"""Python garbage-collection pauses of a process, for performance work (API servers, VLLM_ENGINE_STEP_TIMING=1).

A full (generation 2) collection walks every tracked object of the process: in an API server, which imports
torch, ~200k objects and ~0.1 s during which its event loop serves no stream. `GcTimer` sums each generation's
collections and the time they paused the process (gc.callbacks: two calls per collection, nothing per step), and
`report()` turns that into one log line per window.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcTimer:
    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.paused_s = [0.0, 0.0, 0.0]
        self.longest_s = 0.0
        self.since = time.perf_counter()
        self._start = 0.0

    def install(self) -> GcTimer:
        gc.callbacks.append(self._callback)
        return self

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        elapsed = time.perf_counter() - self._start
        generation = info["generation"]
        self.counts[generation] += 1
        self.paused_s[generation] += elapsed
        self.longest_s = max(self.longest_s, elapsed)

    def report(self) -> str:
        """One line: collections and pause time per generation since the last report, the share of wall time
        paused and the longest pause; then resets."""
        now = time.perf_counter()
        window = max(now - self.since, 1e-9)
        parts = " ".join(f"gen{g} {n} ({1e3 * t:.1f} ms)" for g, (n, t) in enumerate(zip(self.counts,
                                                                                          self.paused_s)))
        line = (f"{parts}; paused {100 * sum(self.paused_s) / window:.1f}% of {window:.1f} s, longest "
                f"{1e3 * self.longest_s:.1f} ms")
        self.counts, self.paused_s, self.longest_s, self.since = [0, 0, 0], [0.0, 0.0, 0.0], 0.0, now
        return line
