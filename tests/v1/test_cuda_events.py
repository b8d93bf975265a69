"""vllm/v1/cuda_events.host_event: spin-waiting CUDA events by default, blocking-sync ones with
VLLM_OUTPUT_BLOCKING_SYNC=1 (torch.cuda.Event replaced by a recorder, so it runs without CUDA)."""

from __future__ import annotations

import pytest
import torch

from vllm.v1 import cuda_events


@pytest.mark.parametrize(("value", "blocking"), [(None, False), ("0", False), ("1", True)])
def test_host_event_blocking_follows_the_switch(monkeypatch: pytest.MonkeyPatch, value: str | None,
                                                 blocking: bool) -> None:
    made: list[dict] = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kwargs: made.append(kwargs) or object())
    if value is None:
        monkeypatch.delenv("VLLM_OUTPUT_BLOCKING_SYNC", raising=False)
    else:
        monkeypatch.setenv("VLLM_OUTPUT_BLOCKING_SYNC", value)
    cuda_events.host_event()
    assert made == [{"blocking": blocking}]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_blocking_event_waits_for_the_work_it_follows(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OUTPUT_BLOCKING_SYNC", "1")
    x = torch.randn(2048, 2048, device="cuda")
    y = x @ x
    host = torch.empty(y.shape, dtype=y.dtype, pin_memory=True)
    host.copy_(y, non_blocking=True)
    event = cuda_events.host_event()
    event.record()
    event.synchronize()
    assert torch.equal(host, y.cpu())
