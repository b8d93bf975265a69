"""Decode padding for CUDA graphs: a padded decode step gives the real rows the logits of the unpadded step
(torch backend and the Triton kernel with a fixed split count, on CPU), and on CUDA a replayed graph gives the
logits of the eager forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.layer import set_attn_backend
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.worker.cudagraph import CudaGraphManager, resolve_capture_sizes
from vllm.v1.worker.model_runner import ModelRunner

BLOCK_SIZE = 4
PROMPTS = [[5, 17, 42, 9, 3], [1, 2, 3, 4, 5, 6, 7], [30, 31, 32], [8, 8, 8, 8, 8, 8, 8, 8, 8]]


class _LogitsRecorder:
    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, metadata: Any) -> Any:
        self.logits.append(logits.detach().float().cpu().clone())
        return self.sampler(logits, metadata)


def _runner(device: str, dtype: str = "float32", enforce_eager: bool = True,
            capture_sizes: list[int] | None = None) -> tuple[ModelRunner, _LogitsRecorder]:
    config = VllmConfig(
        model_config=ModelConfig(dtype=dtype, max_model_len=64, enforce_eager=enforce_eager,
                                 cudagraph_capture_sizes=capture_sizes),
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=False),
        device_config=DeviceConfig(device=device))
    runner = ModelRunner(config)
    runner.initialize_kv_cache(40)
    recorder = _LogitsRecorder(runner.sampler)
    runner.sampler = recorder  # type: ignore[assignment]
    return runner, recorder


def _run_steps(runner: ModelRunner, num_reqs: int, num_decodes: int) -> list[list[int]]:
    """Prefill the first num_reqs prompts in one step, then decode num_decodes steps; returns sampled ids."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [f"r{i}" for i in range(num_reqs)]
    # Request i owns blocks 4i..4i+3 (16 tokens).
    blocks = {r: list(range(4 * i, 4 * i + 4)) for i, r in enumerate(ids)}
    new = [NewRequestData(r, PROMPTS[i], [], params, blocks[r], 0) for i, r in enumerate(ids)]
    sched = {r: len(PROMPTS[i]) for i, r in enumerate(ids)}
    out = runner.execute_model(SchedulerOutput(new, CachedRequestData(), sched, sum(sched.values()), set()))
    tokens = [list(t) for t in out.sampled_token_ids]
    computed = dict(sched)
    for _ in range(num_decodes):
        # Reverse order each step, so rows and step order differ.
        ids = ids[::-1]
        cached = CachedRequestData(list(ids), [[] for _ in ids], [computed[r] for r in ids])
        out = runner.execute_model(SchedulerOutput([], cached, {r: 1 for r in ids}, len(ids), set()))
        for r in ids:
            tokens[int(r[1:])] += out.sampled_token_ids[out.req_id_to_index[r]]
            computed[r] += 1
    return tokens


def test_capture_sizes() -> None:
    assert resolve_capture_sizes(None, 10, 8192) == [1, 2, 4, 8, 10]
    assert resolve_capture_sizes(None, 2048, 300) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 300]
    assert resolve_capture_sizes([3, 1, 64], 32, 8192) == [1, 3]
    manager = CudaGraphManager([1, 2, 4, 8])
    assert [manager.padded_size(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]


@pytest.mark.parametrize("backend", ["TORCH", "TRITON"])
@pytest.mark.parametrize("num_reqs", [1, 3])
def test_padded_decode_matches_unpadded(backend: str, num_reqs: int) -> None:
    # NOTE: the knob, not the environment: a test that sets the knob may leave TRITON_INTERPRET="0" behind.
    if backend == "TRITON" and torch.cuda.is_available() and not triton.knobs.runtime.interpret:
        pytest.skip("CPU tensors through Triton need the interpreter; test_graph_replay_matches_eager covers CUDA")
    num_decodes = 2 if backend == "TRITON" else 3
    ref, ref_rec = _runner("cpu")
    padded, pad_rec = _runner("cpu", capture_sizes=[2, 4])
    padded.pad_eager_decode = True
    if backend == "TRITON":
        for runner in (ref, padded):
            runner.attn_backend = TritonAttentionBackend()
            set_attn_backend(runner.model, runner.attn_backend)
        # More splits than the short contexts have key tiles: the empty splits must not change the result.
        padded._graph_num_splits = lambda num_rows: 4  # type: ignore[method-assign]
    seen_pads: list[int | None] = []
    prepare = padded.input_buffers.prepare
    padded.input_buffers.prepare = lambda *a, **k: (seen_pads.append(a[2]), prepare(*a, **k))[1]  # type: ignore
    assert _run_steps(padded, num_reqs, num_decodes) == _run_steps(ref, num_reqs, num_decodes)
    assert seen_pads == [None] + [2 if num_reqs == 1 else 4] * num_decodes
    for a, b in zip(pad_rec.logits, ref_rec.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("num_reqs", [1, 3, 4])
def test_graph_replay_matches_eager(num_reqs: int) -> None:
    eager, eager_rec = _runner("cuda", enforce_eager=True)
    graphs, graph_rec = _runner("cuda", enforce_eager=False, capture_sizes=[1, 2, 4, 8])
    graphs.capture_model()
    assert sorted(graphs.cudagraphs.graphs) == [1, 2, 4, 8]
    replays: list[int] = []
    replay = graphs.cudagraphs.replay
    graphs.cudagraphs.replay = lambda size: (replays.append(size), replay(size))[1]  # type: ignore
    assert _run_steps(graphs, num_reqs, 4) == _run_steps(eager, num_reqs, 4)
    assert replays == [graphs.cudagraphs.padded_size(num_reqs)] * 4
    for a, b in zip(graph_rec.logits, eager_rec.logits):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
