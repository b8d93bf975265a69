"""SamplingParams.prompt_logprobs end to end (offline LLM, bundled tiny model on CPU), against a float64
log-softmax of Hugging Face transformers' logits for the same checkpoint: with chunked prefill forced (several
chunks per prompt, across steps) and without, with and without async scheduling, mixed in one batch with requests
that do not ask (whose outputs must not change), flat_logprobs, n > 1, k = 0 and k = -1."""

from __future__ import annotations

import pytest
import torch

from vllm import LLM, SamplingParams
from vllm.config.model import default_model_path
from vllm.exceptions import VLLMValidationError
from vllm.logprobs import FlatLogprobs

PROMPTS = [
    [0, 5, 17, 42, 9, 100, 3, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 300, 301, 302, 4000, 77],
    [0, 900, 901, 33],
    [7],
    [0, 12, 250, 251, 252, 2000, 64, 65, 66, 67, 1, 2, 3],
]
GREEDY = dict(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def hf_logprobs() -> dict[tuple[int, ...], torch.Tensor]:
    """Per prompt: [P - 1, V] float64 log-softmax of HF's logits at positions 0..P-2 (the distribution of prompt
    tokens 1..P-1)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), torch_dtype=torch.float32).eval()
    out = {}
    with torch.no_grad():
        for p in PROMPTS:
            logits = hf(torch.tensor([p])).logits[0, :-1].double()
            out[tuple(p)] = logits.log_softmax(-1)
    return out


@pytest.fixture(scope="module")
def chunked() -> LLM:
    # NOTE: 8 tokens per step chunks the 25-token prompt over 4 steps; max_logprobs covers k = -1 (vocab 4096).
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, block_size=4, max_num_batched_tokens=8,
               max_logprobs=4096)


@pytest.fixture(scope="module")
def whole() -> LLM:
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, block_size=4, async_scheduling=True)


def check_against_reference(prompt: list[int], plp: list, ref: torch.Tensor, k: int) -> None:
    """plp (vLLM's prompt_logprobs) against ref [P - 1, V] float64 with k top tokens per position."""
    assert len(plp) == len(prompt)
    assert plp[0] is None
    for j in range(1, len(prompt)):
        row, entries, token = ref[j - 1], plp[j], prompt[j]
        for t, lp in entries.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=2e-4)
        # vLLM's rank: 1 + the tokens with a larger logprob (ties against it); float32 against float64 may move
        # exact neighbours, so it lies between the strict count and the count within the tolerance.
        rank = entries[token].rank
        assert int((row > row[token] + 1e-4).sum()) + 1 <= rank <= int((row >= row[token] - 1e-4).sum())
        # The top k: ranks 1..k (the prompt token's entry is its top-k one when it is among them), in HF's order
        # of logprobs, and as large as HF's k largest (up to what float32 can tell apart).
        top = sorted((lp.rank, t) for t, lp in entries.items() if t != token or lp.rank <= k)
        assert [r for r, _ in top] == list(range(1, k + 1))
        assert set(entries) == {token} | {t for _, t in top}
        if k:
            values = row[[t for _, t in top]]
            assert torch.all(values[:-1] >= values[1:] - 1e-4)
            assert values[-1].item() >= row.topk(k).values[-1].item() - 1e-4


@pytest.mark.parametrize("engine", ["chunked", "whole"])
def test_prompt_logprobs_match_transformers(engine: str, request: pytest.FixtureRequest,
                                            hf_logprobs: dict) -> None:
    llm: LLM = request.getfixturevalue(engine)
    params = [SamplingParams(**GREEDY, prompt_logprobs=k) for k in (3, 1, 2, 0)]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, out, k in zip(PROMPTS, outs, (3, 1, 2, 0)):
        check_against_reference(p, out.prompt_logprobs, hf_logprobs[tuple(p)], k)


def test_mixed_batch_leaves_other_requests_unchanged(chunked: LLM, hf_logprobs: dict) -> None:
    """Requests without prompt_logprobs in the same steps: None for them, and the same tokens and sample logprobs
    as in a batch where nobody asks."""
    plain = [SamplingParams(**GREEDY, logprobs=2) for _ in PROMPTS]
    mixed = [SamplingParams(**GREEDY, logprobs=2, prompt_logprobs=2 if i % 2 == 0 else None)
             for i in range(len(PROMPTS))]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    ref = chunked.generate(prompts, plain, use_tqdm=False)
    outs = chunked.generate(prompts, mixed, use_tqdm=False)
    for i, (p, a, b) in enumerate(zip(PROMPTS, ref, outs)):
        assert a.prompt_logprobs is None
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.outputs[0].logprobs == a.outputs[0].logprobs
        if i % 2:
            assert b.prompt_logprobs is None
        else:
            check_against_reference(p, b.prompt_logprobs, hf_logprobs[tuple(p)], 2)


def test_flat_logprobs_n_and_text_prompts(chunked: LLM) -> None:
    prompt = {"prompt_token_ids": PROMPTS[0]}
    base = chunked.generate(prompt, SamplingParams(**GREEDY, prompt_logprobs=2), use_tqdm=False)[0]
    flat = chunked.generate(prompt, SamplingParams(**GREEDY, prompt_logprobs=2, flat_logprobs=True),
                            use_tqdm=False)[0]
    assert isinstance(flat.prompt_logprobs, FlatLogprobs)
    assert flat.prompt_logprobs == base.prompt_logprobs
    assert flat.prompt_logprobs[0] is None
    both = chunked.generate(prompt, SamplingParams(temperature=1.0, max_tokens=3, n=3, seed=5,
                                                   prompt_logprobs=2), use_tqdm=False)[0]
    assert len(both.outputs) == 3
    assert both.prompt_logprobs == base.prompt_logprobs
    # decoded tokens as the tokenizer decodes each id alone
    text_out = chunked.generate("Hello world, this is", SamplingParams(**GREEDY, prompt_logprobs=1),
                                use_tqdm=False)[0]
    tok = chunked.get_tokenizer()
    for j, token_id in enumerate(text_out.prompt_token_ids[1:], 1):
        assert text_out.prompt_logprobs[j][token_id].decoded_token == tok.decode([token_id])


def test_whole_vocabulary_and_limits(chunked: LLM, whole: LLM) -> None:
    out = chunked.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(**GREEDY, prompt_logprobs=-1),
                           use_tqdm=False)[0]
    vocab = 4096
    for entries in out.prompt_logprobs[1:]:
        assert len(entries) == vocab
        assert sorted(lp.rank for lp in entries.values()) == list(range(1, vocab + 1))
        total = torch.tensor([lp.logprob for lp in entries.values()], dtype=torch.float64).exp().sum()
        assert total.item() == pytest.approx(1.0, abs=1e-4)
    with pytest.raises(VLLMValidationError, match="prompt_logprobs"):
        whole.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="prompt_logprobs"):
        whole.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(prompt_logprobs=21), use_tqdm=False)
    for bad in (-2, 1.5, True, "1"):
        with pytest.raises(VLLMValidationError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_raw_logprobs_whatever_the_sampling_settings(whole: LLM) -> None:
    """Prompt logprobs ignore temperature and the other sampling settings (vLLM's are raw)."""
    prompt = {"prompt_token_ids": PROMPTS[3]}
    a = whole.generate(prompt, SamplingParams(**GREEDY, prompt_logprobs=3), use_tqdm=False)[0]
    b = whole.generate(prompt, SamplingParams(temperature=0.3, top_k=2, top_p=0.5, max_tokens=2,
                                              prompt_logprobs=3), use_tqdm=False)[0]
    assert [None if e is None else {t: round(lp.logprob, 5) for t, lp in e.items()} for e in a.prompt_logprobs] \
        == [None if e is None else {t: round(lp.logprob, 5) for t, lp in e.items()} for e in b.prompt_logprobs]


PREEMPT_PROMPTS = [[0, *range(10 + 3 * i, 10 + 3 * i + 8 + i)] for i in range(8)]


@pytest.mark.parametrize("async_scheduling,padded", [(False, False), (True, True)])
def test_preemption_and_padded_steps(async_scheduling: bool, padded: bool) -> None:
    """12 blocks of 4 tokens cannot hold 8 growing requests: preempted requests (during or after their prefill)
    still get their prompt logprobs exactly once, equal to the reference; with the runner's padded eager steps
    (the CUDA-graph layouts of decode and mixed steps) too."""
    import transformers

    llm = LLM(device="cpu", max_num_seqs=8, max_model_len=32, block_size=4, num_gpu_blocks_override=12,
              max_num_batched_tokens=8, async_scheduling=async_scheduling)
    core = llm.llm_engine.engine_core.engine_core
    runner = core.worker.model_runner
    runner.pad_eager_decode = runner.pad_eager_mixed = padded
    sched, preempted = core.scheduler, []
    original = sched._preempt
    sched._preempt = lambda req: (preempted.append(req.request_id), original(req))[1]
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PREEMPT_PROMPTS], params, use_tqdm=False)
    assert preempted, "the KV budget was meant to force preemption"
    assert not runner.prompt_logprobs.requests
    hf = transformers.AutoModelForCausalLM.from_pretrained(default_model_path(), torch_dtype=torch.float32).eval()
    for p, out in zip(PREEMPT_PROMPTS, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, :-1].double().log_softmax(-1)
        check_against_reference(p, out.prompt_logprobs, ref, 2)


def test_several_passes_per_step(whole: LLM, hf_logprobs: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's prompt rows go through the LM head in passes of MAX_ROWS_PER_PASS: 3 here, so passes split the
    rows of one request and straddle two requests."""
    import vllm.v1.worker.prompt_logprobs as plp_module

    monkeypatch.setattr(plp_module, "MAX_ROWS_PER_PASS", 3)
    outs = whole.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**GREEDY, prompt_logprobs=2),
                          use_tqdm=False)
    for p, out in zip(PROMPTS, outs):
        check_against_reference(p, out.prompt_logprobs, hf_logprobs[tuple(p)], 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_chunked_and_mixed(hf_logprobs: dict) -> None:
    """On CUDA with its defaults (bf16, async scheduling, decode / mixed forward graphs, sampler graphs) and
    16-token steps: prompt logprobs close to the float64 reference (bf16 tolerance), and the requests that do
    not ask get the same tokens as in a batch where nobody asks."""
    llm = LLM(device="cuda", max_num_seqs=8, max_model_len=128, max_num_batched_tokens=16, gpu_memory_utilization=0.3)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    plain = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
    mixed = llm.generate(prompts, [SamplingParams(**GREEDY, prompt_logprobs=2 if i % 2 == 0 else None)
                                   for i in range(len(PROMPTS))], use_tqdm=False)
    for i, (p, a, b) in enumerate(zip(PROMPTS, plain, mixed)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        if i % 2:
            assert b.prompt_logprobs is None
            continue
        assert len(b.prompt_logprobs) == len(p) and b.prompt_logprobs[0] is None
        ref = hf_logprobs[tuple(p)]
        for j in range(1, len(p)):
            entries = b.prompt_logprobs[j]
            assert len(entries) in (2, 3)
            for t, lp in entries.items():
                assert lp.logprob == pytest.approx(ref[j - 1, t].item(), abs=0.1)


def test_abort_during_prefill_forgets_the_request(chunked: LLM, hf_logprobs: dict) -> None:
    """A request aborted between its prompt chunks leaves no state in the runner, and a later request with the
    same id starts over (its rows equal the reference, not the first one's partial rows plus its own)."""
    engine = chunked.llm_engine
    runner = engine.engine_core.engine_core.worker.model_runner
    params = SamplingParams(**GREEDY, prompt_logprobs=1)
    engine.add_request("plp-abort", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    engine.step()
    assert "plp-abort" in runner.prompt_logprobs.requests  # 25 prompt tokens, 8 per step: still in prefill
    engine.abort_request(["plp-abort"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("other", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(**GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
    assert not runner.prompt_logprobs.requests
    engine.add_request("plp-abort", {"prompt_token_ids": PROMPTS[0]}, params)
    finals = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["plp-abort"]
    check_against_reference(PROMPTS[0], finals[0].prompt_logprobs, hf_logprobs[tuple(PROMPTS[0])], 1)
