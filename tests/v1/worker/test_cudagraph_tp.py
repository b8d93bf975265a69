"""CUDA graphs under tensor parallelism, on CPU (the capture itself needs a GPU; these check the choices around
it): a sampler-graph capture that fails on one rank re-raises with several ranks (a rank going eager alone would
leave the ranks out of step) and falls back to eager at one rank; forward graphs capture in "thread_local" error
mode with several ranks (NCCL's threads touch CUDA during the capture), torch's default "global" at one."""

from __future__ import annotations

import pytest
import torch

import vllm.v1.worker.cudagraph as cudagraph
from vllm.v1.worker.cudagraph import SamplerGraphs


def _failing_graphs(monkeypatch: pytest.MonkeyPatch, tp_size: int) -> SamplerGraphs:
    monkeypatch.setattr(cudagraph, "get_tensor_model_parallel_world_size", lambda: tp_size)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    graphs = SamplerGraphs([1, 2], capture=False)
    graphs.capture = True  # NOTE: capture=True builds pools, which need a GPU; the capture itself is replaced

    def fail(key: object, make_fn: object) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    graphs._capture_all = fail  # type: ignore[method-assign]
    return graphs


def test_sampler_capture_failure_reraises_with_several_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = _failing_graphs(monkeypatch, tp_size=2)
    with pytest.raises(RuntimeError, match="stream is capturing"):
        graphs.run(1, "key", lambda size: lambda: None)
    assert not graphs.failed


def test_sampler_capture_failure_falls_back_to_eager_at_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    graphs = _failing_graphs(monkeypatch, tp_size=1)
    assert graphs.run(1, "key", lambda size: lambda: None) is None  # None: the caller runs the sampler eagerly
    assert graphs.failed


@pytest.mark.parametrize("tp_size, mode", [(1, "global"), (2, "thread_local"), (4, "thread_local")])
def test_forward_capture_error_mode(monkeypatch: pytest.MonkeyPatch, tp_size: int, mode: str) -> None:
    monkeypatch.setattr(cudagraph, "get_tensor_model_parallel_world_size", lambda: tp_size)
    assert cudagraph._forward_capture_error_mode() == mode
