"""Penalties and logits processors end to end through LLM (scheduler, runner, penalty state, sampler).

References: HF transformers' RepetitionPenaltyLogitsProcessor (its `generate(repetition_penalty=...)`), and a
numpy loop over HF's logits for the frequency and presence penalties; both on greedy decoding of tiny random
models, under chunked prefill, async scheduling (the sampled ids of step N feed N+1 on the device, and the
penalty counts must include them), preemption (the counts rebuilt from prompt + outputs on resume), the fast
path (top_k=1, temperature > 0) and the padded sampler-graph metadata (run eagerly on CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.v1.worker.cudagraph import SamplerGraphs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
from hf_model_utils import make_hf_model  # noqa: E402

PROMPTS = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [90, 90, 91], [3, 140, 7, 7, 7, 22, 58]]
MAX_TOKENS = 16
_REFERENCE: dict[tuple, list[int]] = {}


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("qwen2")
    return make_hf_model("qwen2", path, seed=3), path


def numpy_greedy(hf: torch.nn.Module, prompt: list[int], rep: float, freq: float, pres: float) -> list[int]:
    """Greedy decoding with vLLM's penalties applied in float64 numpy to HF's logits (cached per case)."""
    key = (tuple(prompt), rep, freq, pres)
    if key in _REFERENCE:
        return _REFERENCE[key]
    ids = list(prompt)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].double().numpy()
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=x.size).astype(np.float64)
        seen = counts > 0
        seen[prompt] = True
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
        x = x - freq * counts - pres * (counts > 0)
        token = int(np.argmax(x))
        out.append(token)
        ids.append(token)
    _REFERENCE[key] = out
    return out


def make_llm(path: Path, mode: str) -> LLM:
    kwargs: dict = dict(device="cpu", skip_tokenizer_init=True, max_num_seqs=4, block_size=4,
                        max_num_batched_tokens=8)  # chunked prefill of the longer prompts
    if mode == "async":
        kwargs["async_scheduling"] = True
    if mode == "preempt":
        kwargs.update(max_num_batched_tokens=64, max_model_len=32, num_gpu_blocks_override=10)
    llm = LLM(str(path), **kwargs)
    if mode == "padded_graph_metadata":
        runner = llm.llm_engine.engine_core.engine_core.worker.model_runner
        runner.pad_eager_decode = True
        runner.sampler_graphs = SamplerGraphs(runner.cudagraphs.capture_sizes, capture=False)
        graphs = runner.sampler_graphs
        llm.graph_runs = []  # type: ignore[attr-defined]
        run = graphs.run
        graphs.run = lambda size, key, fn: (llm.graph_runs.append(size), run(size, key, fn))[1]  # type: ignore
    if mode == "preempt":
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        llm.preempted = []  # type: ignore[attr-defined]
        original = sched._preempt
        sched._preempt = lambda req: (llm.preempted.append(req.request_id), original(req))[1]  # type: ignore
    return llm


def generate(llm: LLM, **params: float) -> list[list[int]]:
    sp = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **params)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("rep", [1.3, 0.7])
def test_repetition_penalty_equals_transformers(hf_model, rep: float) -> None:
    hf, path = hf_model
    llm = make_llm(path, "plain")
    got = generate(llm, temperature=0.0, repetition_penalty=rep)
    for prompt, tokens in zip(PROMPTS, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                              repetition_penalty=rep)[0, len(prompt):]
        assert tokens == ref.tolist()
    # The penalty changes the output: the test could fail.
    assert got != generate(llm, temperature=0.0)


@pytest.mark.parametrize("mode", ["plain", "async", "preempt", "fast_path", "padded_graph_metadata"])
def test_penalties_equal_numpy_reference(hf_model, mode: str) -> None:
    hf, path = hf_model
    llm = make_llm(path, mode)
    graphed = mode in ("fast_path", "padded_graph_metadata")  # top_k on every row: the fast path, graphable
    sampling = dict(temperature=1.0, top_k=1) if graphed else dict(temperature=0.0)
    for rep, freq, pres in ((1.0, 0.9, 0.0), (1.0, 0.0, 1.5), (1.2, 0.4, 0.5), (1.0, -0.5, 0.0)):
        got = generate(llm, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, **sampling)
        want = [numpy_greedy(hf, p, rep, freq, pres) for p in PROMPTS]
        assert got == want, (mode, rep, freq, pres)
    if mode == "padded_graph_metadata":
        assert llm.graph_runs, "the steps were meant to sample through the (eager) sampler graphs"  # type: ignore
    if mode == "preempt":
        assert llm.preempted, "the KV budget was meant to force preemption"  # type: ignore[attr-defined]
    # Requests without penalties run next to each other in the same engine as before (no leftover state).
    assert generate(llm, **sampling) == [numpy_greedy(hf, p, 1.0, 0.0, 0.0) for p in PROMPTS]


def test_min_tokens_keeps_eos_out_of_draws_and_masks() -> None:
    """EOS pushed to the top with logit_bias: never drawn and never in the mask before min_tokens, drawn at once
    after it."""
    llm = LLM(device="cpu", max_num_seqs=4, max_model_len=128, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")
    eos = llm.llm_engine.input_processor.eos_token_id
    assert eos is not None
    base = dict(temperature=1.0, top_k=20, max_tokens=40, logit_bias={eos: 100.0}, seed=0)
    first = llm.generate("The function", SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    assert list(first.token_ids) == [eos]  # the bias works: without min_tokens EOS comes first
    for min_tokens in (1, 7, 15):
        out = llm.generate(["The function", "A module is"], SamplingParams(**base, min_tokens=min_tokens),
                           use_tqdm=False)
        for o in out:
            c = o.outputs[0]
            masks = c.sampling_mask.token_ids
            assert list(c.token_ids[:min_tokens]).count(eos) == 0
            assert all(eos not in m for m in masks[:min_tokens])
            assert len(c.token_ids) == min_tokens + 1 and c.token_ids[-1] == eos
            assert eos in masks[min_tokens]
            assert all(t in m for t, m in zip(c.token_ids, masks))


def test_allowed_token_ids_and_bad_words_shape_the_mask() -> None:
    llm = LLM(device="cpu", max_num_seqs=4, max_model_len=128, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")
    allowed = [11, 12, 13, 200, 201, 202, 3000]
    out = llm.generate("The function", SamplingParams(temperature=1.0, top_k=50, max_tokens=20, ignore_eos=True,
                                                      allowed_token_ids=allowed, seed=1), use_tqdm=False)
    c = out[0].outputs[0]
    assert set(c.token_ids) <= set(allowed)
    assert all(set(m) == set(allowed) for m in c.sampling_mask.token_ids)  # top_k 50 > 7 allowed: all kept
    free = llm.generate("The function", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                       return_sampling_mask=False), use_tqdm=False)[0].outputs[0]
    banned_word = llm.get_tokenizer().decode([free.token_ids[0]])
    out = llm.generate("The function", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                      bad_words=[banned_word], return_sampling_mask=False),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids[0] != free.token_ids[0]
