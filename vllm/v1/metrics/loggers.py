"""PrometheusStatLogger: the engine's Prometheus metrics (vLLM's `vllm:` names where they exist).

Each logger owns its own CollectorRegistry, so several engines in one process (tests) do not collide;
`/metrics` renders `generate_latest(logger.registry)`. Every sample carries `engine="i"`, the data-parallel rank of
the engine core it describes (vLLM's label; "0" without data parallel), so the engines of one server are told
apart and sum up with `sum without (engine)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import prometheus_client as prom

from vllm.v1.engine import SchedulerStats
from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats

_LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0]
_MASK_SIZE_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 16384, 65536, 262144]


def _observe_many(histogram: Any, values: list[int]) -> None:
    """`histogram.observe(v)` for every v, in one pass: a step brings one mask size per row (up to 1024).

    NOTE: uses prometheus_client's Histogram child internals (`_upper_bounds`, per-bucket `_buckets`, `_sum`),
    the same fields its own `observe` updates; tests/v1/test_metrics checks the result against `observe`."""
    bounds = np.asarray(histogram._upper_bounds)
    counts = np.bincount(np.searchsorted(bounds, np.asarray(values), side="left"), minlength=len(bounds))
    for i in np.flatnonzero(counts).tolist():
        histogram._buckets[i].inc(int(counts[i]))
    histogram._sum.inc(float(np.sum(values)))


class _EngineMetrics:
    """One engine core's children of every metric (labels model_name and engine)."""

    def __init__(self, families: dict[str, Any], model_name: str, engine: int, num_gpu_blocks: int) -> None:
        labels = (model_name, str(engine))
        self.labels = labels
        self.num_gpu_blocks = num_gpu_blocks
        for name, family in families.items():
            if name != "counter_request_success":
                setattr(self, name, family.labels(*labels))
        self.counter_request_success = families["counter_request_success"]
        self.gauge_num_blocks.set(num_gpu_blocks)


class PrometheusStatLogger:
    """The metrics of the engine cores behind one frontend: every sample labelled `model_name` and `engine` (the
    engine core's data-parallel rank, as vLLM labels them; "0" without data parallel). The record_* calls take
    the engine whose outputs they account."""

    def __init__(self, model_name: str, num_gpu_blocks: int | list[int]) -> None:
        """num_gpu_blocks: each engine core's KV cache blocks (one int: one engine)."""
        self.registry = prom.CollectorRegistry()
        labels = ["model_name", "engine"]
        r = self.registry
        families: dict[str, Any] = {
            "gauge_running": prom.Gauge("vllm:num_requests_running", "Requests in the running batch.", labels,
                                        registry=r),
            "gauge_waiting": prom.Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels,
                                        registry=r),
            "gauge_kv_usage": prom.Gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                         labels, registry=r),
            "gauge_kv_used_blocks": prom.Gauge("vllm:kv_cache_used_blocks", "KV cache blocks in use.", labels,
                                               registry=r),
            "gauge_num_blocks": prom.Gauge("vllm:num_gpu_blocks", "KV cache blocks in the pool.", labels,
                                           registry=r),
            "counter_preemptions": prom.Counter("vllm:num_preemptions", "Preemptions.", labels, registry=r),
            "counter_prefix_cache_queries": prom.Counter(
                "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", labels,
                registry=r),
            "counter_prefix_cache_hits": prom.Counter(
                "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", labels,
                registry=r),
            "counter_prompt_tokens": prom.Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels,
                                                  registry=r),
            "counter_generation_tokens": prom.Counter("vllm:generation_tokens", "Generated tokens.", labels,
                                                      registry=r),
            "counter_request_success": prom.Counter("vllm:request_success", "Finished requests by finish reason.",
                                                    labels + ["finished_reason"], registry=r),
            "hist_ttft": prom.Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                                        buckets=_LATENCY_BUCKETS, registry=r),
            "hist_tpot": prom.Histogram("vllm:time_per_output_token_seconds", "Mean time per output token.",
                                        labels, buckets=_LATENCY_BUCKETS, registry=r),
            "hist_e2e": prom.Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                                       buckets=_LATENCY_BUCKETS, registry=r),
            "hist_mask_size": prom.Histogram("vllm:sampling_mask_size", "Ids in each returned sampling mask.",
                                             labels, buckets=_MASK_SIZE_BUCKETS, registry=r),
            "counter_mask_overflow": prom.Counter(
                "vllm:sampling_mask_overflow_rows",
                "Mask rows larger than their top_k (served by the bitmask path).", labels, registry=r),
        }
        blocks = [num_gpu_blocks] if isinstance(num_gpu_blocks, int) else list(num_gpu_blocks)
        self.model_name = model_name
        self.engines = [_EngineMetrics(families, model_name, e, n) for e, n in enumerate(blocks)]

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        m = self.engines[engine]
        m.gauge_running.set(stats.num_running_reqs)
        m.gauge_waiting.set(stats.num_waiting_reqs)
        m.gauge_kv_usage.set(stats.kv_cache_usage)
        m.gauge_kv_used_blocks.set(round(stats.kv_cache_usage * m.num_gpu_blocks))
        if stats.num_preemptions:
            m.counter_preemptions.inc(stats.num_preemptions)
        if stats.prefix_cache_queries:
            m.counter_prefix_cache_queries.inc(stats.prefix_cache_queries)
            m.counter_prefix_cache_hits.inc(stats.prefix_cache_hits)
        if stats.sampling_mask_sizes:
            _observe_many(m.hist_mask_size, stats.sampling_mask_sizes)
        if stats.num_sampling_mask_overflow_rows:
            m.counter_mask_overflow.inc(stats.num_sampling_mask_overflow_rows)

    def record_iteration(self, stats: IterationStats, engine: int = 0) -> None:
        m = self.engines[engine]
        if stats.num_prompt_tokens:
            m.counter_prompt_tokens.inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            m.counter_generation_tokens.inc(stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            m.hist_ttft.observe(ttft)
        self.record_finished(stats.finished, engine)

    def record_finished(self, finished: list[FinishedRequestStats], engine: int = 0) -> None:
        m = self.engines[engine]
        for f in finished:
            m.counter_request_success.labels(*m.labels, f.finish_reason).inc()
            m.hist_e2e.observe(f.e2e_latency)
            if f.time_per_output_token is not None:
                m.hist_tpot.observe(f.time_per_output_token)

    def render(self) -> bytes:
        return prom.generate_latest(self.registry)
