"""The step timing's device phases (VLLM_ENGINE_STEP_TIMING on CUDA): `dev.step`, a step's device time, and
`dev.gap`, the compute stream idle before it, from timing events around each step (AsyncOutputCopier)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from vllm.v1.metrics.step_timing import StepTimer
from vllm.v1.worker import async_output


class _Event:
    """A completed timing event at `t_ms` on the device's clock."""

    def __init__(self, t_ms: float) -> None:
        self.t_ms = t_ms

    def elapsed_time(self, later: _Event) -> float:
        return later.t_ms - self.t_ms


def test_device_times_from_events_hand_worked() -> None:
    timer = StepTimer()
    async_output._add_device_times(timer, None, _Event(10.0), _Event(15.0))  # first step: no gap before it
    async_output._add_device_times(timer, _Event(15.0), _Event(17.0), _Event(20.5))  # 2 ms idle, 3.5 ms busy
    async_output._add_device_times(timer, _Event(20.5), _Event(20.5), _Event(24.0))  # launched ahead: no gap
    async_output._add_device_times(timer, _Event(24.0), _Event(3024.0), _Event(3025.0))  # an idle engine
    assert timer.totals["dev.step"] == pytest.approx((5.0 + 3.5 + 3.5 + 1.0) / 1e3)
    assert timer.totals["dev.gap"] == pytest.approx(2.0 / 1e3)
    for _ in range(4):
        timer.count_step(1)
    line = timer.report()
    assert "dev.step 3.25" in line and "dev.gap 0.50" in line


def test_no_device_timing_on_cpu() -> None:
    copier = async_output.AsyncOutputCopier(torch.device("cpu"), use_thread=False)
    copier.device_timing, copier.timer = True, StepTimer()
    copier.step_started()
    out = copier.submit(["a"], np.array([True]), torch.tensor([5]), None, None, lambda _: None).get_output()
    assert out.sampled_token_ids == [[5]]
    assert "dev.step" not in copier.timer.totals and "dev.gap" not in copier.timer.totals
    copier.timer.count_step(1)
    assert "dev." not in copier.timer.report()  # not reported as zeros


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_step_and_gap_follow_the_device_work_and_the_host_delay() -> None:
    """Three steps, each a sleep kernel of known device time (its own timing events are the reference), the
    device idle >= 20 ms before the second and third: dev.step within 10% of the kernels' time, dev.gap >= 20 ms
    per gap."""
    device = torch.device("cuda")
    copier = async_output.AsyncOutputCopier(device, use_thread=True)
    copier.device_timing, copier.timer = True, StepTimer()
    kernel_ms = 0.0
    for step in range(3):
        torch.cuda.synchronize()
        if step:
            time.sleep(0.02)  # the device has nothing to do meanwhile
        copier.step_started()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        torch.cuda._sleep(5_000_000)
        after.record()
        sampled = torch.tensor([step], device=device)
        out = copier.submit(["a"], np.array([True]), sampled, None, None, lambda _: None).get_output()
        assert out.sampled_token_ids == [[step]]
        kernel_ms += before.elapsed_time(after)
    copier.shutdown()
    assert copier.timer.totals["dev.step"] * 1e3 == pytest.approx(kernel_ms, rel=0.1)
    assert copier.timer.totals["dev.gap"] >= 2 * 0.02
