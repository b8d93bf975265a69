"""Where the engine core's time goes per step, for performance work (VLLM_ENGINE_STEP_TIMING=1).

The engine core adds each phase's wall time (perf_counter) to a StepTimer: `inputs` (reading the frontends'
messages), `schedule`, `launch` (the runner's input preparation and kernel launches), `wait` (blocked on the
oldest step's output: device time and the output thread not hidden behind host work), `update`
(update_from_output) and `send` (splitting, packing, encoding and queueing the outputs). The output thread adds
`out.event` (waiting for the device-to-host copies) and `out.lists` (building the host lists). Parts of
`launch`, added by the model runner: `launch.prep` (request states, input and sampling tensors), `launch.model`
(forward and sampler: graph replays or eager launches), `launch.out` (the outputs' device-to-host copies queued,
the list building handed to the output thread; synchronous scheduling: the wait for the device and the lists
too), of which `launch.mask` is the sampling mask's share; `mask.copied` counts the steps whose masks found no
free lending staging slot and were copied out on the host (vllm/v1/worker/async_output.py); `send.masks` is
the time spent building deferred mask lists (VLLM_ENGINE_DEFER_MASK_LISTS, on by default): part of `send` in the
engine-core process, outside the phases in process (where the caller takes the outputs). On CUDA, with the variable
set, timing events around each step's device work add `dev.step` (from its forward to its sampler's last
operation, compute stream; it also holds any wait for launches inside the step, which eager steps have and
graphed decode steps hardly do) and `dev.gap` (the compute stream idle before the forward, waiting for the
host, plus the step's input copies; gaps of a second or more, an idle engine, are left out). Graphed decode
steps whose `dev.gap` is ~0 keep the device busy. For the main thread's `schedule`, `launch`, `update` and
`send` of the batch-queue loop, the thread's own CPU time (time.thread_time) is added too and reported after
them ("cpu ..."): wall above CPU is time the thread was not running, i.e. waiting for the GIL, blocked in a
call that released it (the launch's copies and CUDA calls), or preempted. With the variable set, the
engine-core process logs ms per step of each every few seconds; the accumulation itself is a few perf_counter /
thread_time calls per step and always on.
"""

from __future__ import annotations

import time
from collections import defaultdict

PHASES = ("inputs", "schedule", "launch", "launch.prep", "launch.model", "launch.out", "launch.mask", "wait",
          "update", "send", "send.masks", "out.event", "out.lists", "dev.step", "dev.gap")


class StepTimer:
    def __init__(self) -> None:
        self.totals: defaultdict[str, float] = defaultdict(float)
        self.events: defaultdict[str, int] = defaultdict(int)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.steps = 0
        self.rows = 0
        self.since = time.perf_counter()

    def add(self, phase: str, seconds: float, cpu_seconds: float | None = None) -> None:
        """`seconds` of wall time in `phase`; `cpu_seconds`: of it, the thread's own CPU time (time.thread_time)."""
        # NOTE: the output thread adds too, without a lock: a value may land in the next report's window.
        self.totals[phase] += seconds
        if cpu_seconds is not None:
            self.cpu[phase] += cpu_seconds

    def count(self, event: str) -> None:
        self.events[event] += 1

    def count_step(self, rows: int) -> None:
        self.steps += 1
        self.rows += rows

    def restart_if_empty(self) -> None:
        """Start the current window now if no step is in it (the core was idle until now)."""
        if not self.steps:
            self.totals.clear()
            self.events.clear()
            self.cpu.clear()
            self.since = time.perf_counter()

    def report(self) -> str:
        """One line: steps/s, rows per step and ms per step of each phase since the last report; then resets."""
        now = time.perf_counter()
        elapsed, steps = now - self.since, max(self.steps, 1)
        # NOTE: the device phases only where they are measured (CUDA), not as zeros.
        parts = " ".join(f"{p} {1e3 * self.totals[p] / steps:.2f}" for p in PHASES
                         if not p.startswith("dev.") or p in self.totals)
        # NOTE: "a.b" phases are other threads' (out.*) or parts of a phase (launch.*).
        busy = sum(self.totals[p] for p in PHASES if "." not in p and p != "wait")
        events = "".join(f", {e} {n}" for e, n in sorted(self.events.items()))
        cpu = " ".join(f"{p} {1e3 * self.cpu[p] / steps:.2f}" for p in PHASES if p in self.cpu)
        line = (f"{self.steps / elapsed:.1f} steps/s, {self.rows / steps:.0f} rows/step, ms/step: {parts}; "
                f"host busy {100 * busy / elapsed:.0f}%{events}" + (f"; cpu {cpu}" if cpu else ""))
        self.totals.clear()
        self.events.clear()
        self.cpu.clear()
        self.steps = self.rows = 0
        self.since = now
        return line
