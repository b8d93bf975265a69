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
