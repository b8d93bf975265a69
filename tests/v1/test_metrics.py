"""The mask-size histogram's bulk update equals prometheus_client's own one-at-a-time `observe`."""

from __future__ import annotations

import numpy as np
import prometheus_client as prom

from vllm.v1.engine import SchedulerStats
from vllm.v1.metrics.loggers import PrometheusStatLogger


def _samples(registry: prom.CollectorRegistry, name: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for m in registry.collect() if m.name == name for s in m.samples if not s.name.endswith("_created")}


def test_bulk_mask_size_observation_equals_observe() -> None:
    sizes = [0, 1, 1, 2, 3, 511, 512, 513, 4096, 10 ** 6] + np.random.default_rng(0).integers(0, 3000, 500).tolist()
    bulk = PrometheusStatLogger("m", 10)
    bulk.record_scheduler_stats(SchedulerStats(sampling_mask_sizes=sizes[:200]))
    bulk.record_scheduler_stats(SchedulerStats(sampling_mask_sizes=sizes[200:], num_sampling_mask_overflow_rows=3))
    one = PrometheusStatLogger("m", 10)
    for size in sizes:
        one.hist_mask_size.observe(size)
    got, want = _samples(bulk.registry, "vllm:sampling_mask_size"), _samples(one.registry, "vllm:sampling_mask_size")
    assert got == want and want[("vllm:sampling_mask_size_count", (("model_name", "m"),))] == len(sizes)
    overflow = _samples(bulk.registry, "vllm:sampling_mask_overflow_rows")
    assert overflow[("vllm:sampling_mask_overflow_rows_total", (("model_name", "m"),))] == 3


def test_step_timer_reports_ms_per_step_and_resets() -> None:
    from vllm.v1.metrics.step_timing import StepTimer
    timer = StepTimer()
    for _ in range(4):
        timer.add("schedule", 0.002)
        timer.add("wait", 0.010)
        timer.add("out.lists", 0.001)
        timer.count_step(8)
    line = timer.report()
    # 4 steps: 2 ms schedule and 10 ms wait each, 8 rows per step.
    assert "8 rows/step" in line and "schedule 2.00" in line and "wait 10.00" in line and "out.lists 1.00" in line
    assert "update 0.00" in line
    assert timer.steps == 0 and not timer.totals
    assert line.endswith("%")  # no counted events: nothing after the host-busy share
    timer.count("mask.copied")
    timer.count("mask.copied")
    timer.count_step(8)
    assert timer.report().endswith(", mask.copied 2") and not timer.events
    timer.add("schedule", 0.004, 0.003)  # wall 4 ms, of it 3 ms on the CPU
    timer.add("send", 0.002, 0.002)
    timer.count_step(8)
    line = timer.report()
    assert "schedule 4.00" in line and line.endswith("; cpu schedule 3.00 send 2.00") and not timer.cpu


def test_step_timer_parts_of_launch_are_reported_but_not_counted_twice() -> None:
    """launch.* phases (the model runner's split of `launch`) are printed, and like out.* they do not add to the
    host-busy share: only the top-level phases do (10 s of launch.model in a ~0 s window stays 0% busy)."""
    from vllm.v1.metrics.step_timing import StepTimer
    timer = StepTimer()
    timer.add("launch.model", 10.0)
    timer.add("launch.mask", 4.0)
    timer.count_step(1)
    line = timer.report()
    assert "launch.model 10000.00" in line and "launch.mask 4000.00" in line and "launch 0.00" in line
    assert line.endswith("host busy 0%")
    timer.add("update", 10.0)  # a main-thread phase is host work
    timer.count_step(1)
    assert not timer.report().endswith("host busy 0%")


def test_gc_timer_counts_collections_by_generation_and_resets() -> None:
    """GcTimer sees the collections this test forces (one full, two young) with their pause times, reports them
    as one line with the paused share of the window, and starts a new window after the report."""
    import gc
    import time

    from vllm.v1.metrics.gc_timing import GcTimer
    timer = GcTimer().install()
    try:
        garbage = [[i] for i in range(50_000)]  # tracked objects for the full collection to walk
        timer.report()  # a new window: the collections that allocating the garbage triggered are left out
        start = time.perf_counter()
        gc.collect(2)
        gc.collect(0)
        gc.collect(0)
        elapsed = time.perf_counter() - start
        del garbage
        assert timer.counts[2] >= 1 and timer.counts[0] >= 2
        assert 0 < sum(timer.paused_s) <= elapsed + 1e-3 and 0 < timer.longest_s <= sum(timer.paused_s)
        line = timer.report()
        assert line.startswith("gen0 ") and " gen2 " in line and "paused " in line and "longest" in line
        assert timer.counts == [0, 0, 0] and timer.paused_s == [0.0, 0.0, 0.0] and timer.longest_s == 0.0
    finally:
        timer.uninstall()
    assert timer._callback not in gc.callbacks


def test_api_server_logs_gc_pauses(monkeypatch, caplog) -> None:  # noqa: ANN001
    """The API server's GC logger (run with VLLM_ENGINE_STEP_TIMING=1) logs a GC line per window and removes its
    callback when cancelled."""
    import asyncio
    import gc
    import logging

    from vllm.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "_GC_TIMING_LOG_S", 0.02)
    before = list(gc.callbacks)

    async def run() -> None:
        task = asyncio.create_task(api_server._log_gc_pauses())
        await asyncio.sleep(0)
        gc.collect()
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    with caplog.at_level(logging.INFO, logger="vllm.entrypoints.openai.api_server"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if " GC: gen0 " in r.getMessage()]
    assert lines and any(" gen2 1 " in line or " gen2 2 " in line for line in lines)
    assert gc.callbacks == before


def test_engine_core_logs_gc_pauses_with_step_timing(monkeypatch, caplog) -> None:  # noqa: ANN001
    """With VLLM_ENGINE_STEP_TIMING=1 the engine core's busy loop logs a GC line after each step-timing line (here a
    forced full collection inside a step shows up as gen2) and removes its callback when the loop ends."""
    import gc
    import logging

    from vllm import envs
    from vllm.v1.engine import core_proc

    class FakeTimer:
        steps = 1

        def add(self, *_: object) -> None: ...
        def restart_if_empty(self) -> None: ...
        def report(self) -> str:
            return "1.0 steps/s, 1 rows/step, ms/step: send 0.1; host busy 1%"

    class FakeCore:
        step_timer = FakeTimer()
        left = 2

        def has_unfinished_requests(self) -> bool:
            return self.left > 0

        def step(self) -> core_proc.EngineCoreOutputs:
            self.left -= 1
            gc.collect()
            return core_proc.EngineCoreOutputs()

    proc = core_proc.EngineCoreProc.__new__(core_proc.EngineCoreProc)  # no sockets: inputs and sends stubbed
    proc.engine_core, proc.should_stop, proc.launches_ahead = FakeCore(), False, False
    proc._process_inputs = lambda block: (setattr(proc, "should_stop", block) or False)  # idle: stop
    proc.send_outputs = lambda outputs: None
    monkeypatch.setattr(envs, "VLLM_ENGINE_STEP_TIMING", True)
    monkeypatch.setattr(core_proc, "_STEP_TIMING_LOG_S", 0.0)
    before = list(gc.callbacks)
    with caplog.at_level(logging.INFO, logger="vllm.v1.engine.core_proc"):
        proc.run_busy_loop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Engine core GC: gen0 ")]
    assert len(lines) == 2 and all(" gen2 1 " in line for line in lines)
    assert gc.callbacks == before
