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
        one.engines[0].hist_mask_size.observe(size)
    got, want = _samples(bulk.registry, "vllm:sampling_mask_size"), _samples(one.registry, "vllm:sampling_mask_size")
    assert got == want and want[("vllm:sampling_mask_size_count", (("engine", "0"), ("model_name", "m")))] == len(sizes)
    overflow = _samples(bulk.registry, "vllm:sampling_mask_overflow_rows")
    assert overflow[("vllm:sampling_mask_overflow_rows_total", (("engine", "0"), ("model_name", "m")))] == 3
