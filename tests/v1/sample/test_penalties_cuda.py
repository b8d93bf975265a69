"""Penalties on CUDA: the float64 conformance with the Triton top-k select and mask kernels, and penalties inside
the sampler CUDA graphs (same tokens as eager, graphs captured with the processors in their key, and a batch
without penalties on the same graphs as before). Skipped without CUDA (the lead runs these on the GPU)."""

from __future__ import annotations

import pytest
import torch
from test_penalties_conformance import check_conformance

from vllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["The function", "A module is", "In Python, a list", "Return the", "class", "import os\n",
           "The default value of", "Raises an exception"]
PENALTIES = dict(presence_penalty=0.5, repetition_penalty=1.1, frequency_penalty=0.2)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_path", "general_path"])
def test_conformance_on_cuda(fast: bool) -> None:
    total, excused = check_conformance(fast, batches=6, rows=4096, device="cuda", seed=99 if fast else 98)
    assert total == 6 * 4096
    assert excused <= total // 1000, excused


def _tokens(llm: LLM, **params) -> list[list[int]]:  # noqa: ANN003
    sp = SamplingParams(temperature=1.0, top_k=1, max_tokens=32, ignore_eos=True, **params)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


def _sampler_keys(llm: LLM) -> set:
    graphs = llm.llm_engine.engine_core.engine_core.worker.model_runner.sampler_graphs
    return set() if graphs is None else set(graphs.keys)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_in_sampler_graphs_match_eager(async_scheduling: bool) -> None:
    """top_k=1: the fast path, graphed; its tokens are the argmax of the penalised logits. float32: in bf16 the tiny
    model's logits tie exactly at a few positions per run, where top_k=1 keeps both ids and the draw between them is
    random (seen on the H100: every difference between runs was such a tie, the mask [a, b] in both). One engine (forward
    graphs on), its sampler graphed or eager (sampler_graphs None), as test_cudagraph's sampler-graph test:
    token for token the same, the penalty state counted on the device before the host sees the tokens."""
    llm = LLM(device="cuda", dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16,
              async_scheduling=async_scheduling)
    runner = llm.llm_engine.engine_core.engine_core.worker.model_runner
    graphs = runner.sampler_graphs
    assert graphs is not None
    runner.sampler_graphs = None
    want_plain = _tokens(llm)
    want = _tokens(llm, **PENALTIES)
    runner.sampler_graphs = graphs
    assert want != want_plain  # the penalties change the output
    assert _tokens(llm) == want_plain
    plain_keys = _sampler_keys(llm)
    assert plain_keys and all(k[-1] is None for k in plain_keys)  # no processors: keys as before
    assert _tokens(llm, **PENALTIES) == want
    new_keys = _sampler_keys(llm) - plain_keys
    assert new_keys and all(k[-1] is not None for k in new_keys)  # captured with the processors
    assert _tokens(llm) == want_plain  # a batch without penalties afterwards: unchanged, on the same graphs
    assert _sampler_keys(llm) == plain_keys | new_keys
