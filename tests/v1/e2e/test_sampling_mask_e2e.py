"""End to end on the bundled model: the returned sampling masks against the contract.

Every token is inside its mask, one ascending mask per token, |mask| <= top_k except ties, and the processed
logprobs of the support sum to 1 (so the support is exactly where the sampler put its probability).
"""

from __future__ import annotations

import math

import pytest

from vllm import LLM, RequestOutputKind, SamplingParams

PROMPTS = ["The function", "A module is", "In Python, a list", "Return the", "class", "import os\n"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=8, max_model_len=256, max_num_batched_tokens=16,
               logprobs_mode="processed_logprobs", return_sampling_mask=True)


def check_masks(completion, top_k: int) -> None:  # noqa: ANN001
    masks = completion.sampling_mask.token_ids
    assert len(masks) == len(completion.token_ids) > 0
    for tok, mask, lps in zip(completion.token_ids, masks, completion.logprobs):
        assert mask == sorted(set(mask)), "ascending, no duplicates"
        assert tok in mask
        assert 1 <= len(mask)
        if len(mask) > top_k:  # only a tie at the k-th value may exceed top_k
            kth = sorted((lps[i].logprob for i in mask if i in lps), reverse=True)
            assert kth[top_k - 1] == kth[-1]
        in_mask = [lps[i].logprob for i in lps if i in mask]
        assert all(lps[i].logprob == -math.inf for i in lps if i not in mask)
        if len(mask) <= len(lps):
            assert sum(math.exp(x) for x in in_mask) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (20, 0.9, 0.0), (8, 0.95, 0.05), (1, 1.0, 0.0)])
def test_masks_match_contract(llm: LLM, top_k: int, top_p: float, min_p: float) -> None:
    params = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=10,
                            logprobs=20, ignore_eos=True, seed=7)
    for out in llm.generate(PROMPTS, params, use_tqdm=False):
        check_masks(out.outputs[0], top_k)
        if top_k == 1:
            assert all(len(m) == 1 for m in out.outputs[0].sampling_mask.token_ids)


def test_masks_with_chunked_prefill_and_mixed_batch(llm: LLM) -> None:
    long_prompt = " ".join(["the value of the list"] * 12)  # several 16-token chunks: partial rows sample nothing
    params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=6, logprobs=4, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=6, max_tokens=9, logprobs=6, ignore_eos=True,
                             return_sampling_mask=False)]
    outs = llm.generate([long_prompt, PROMPTS[0]], params, use_tqdm=False)
    check_masks(outs[0].outputs[0], 4)
    assert outs[1].outputs[0].sampling_mask is None  # per-request opt-out


def test_masks_cut_with_stop_string(llm: LLM) -> None:
    base = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, logprobs=3, ignore_eos=True, seed=11)
    full = llm.generate(PROMPTS[2], base, use_tqdm=False)[0].outputs[0]
    stop = full.text.strip()[:2]
    if len(stop) < 2:
        pytest.skip("model produced no text to stop on")
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, logprobs=3, ignore_eos=True, seed=11,
                            stop=[stop])
    cut = llm.generate(PROMPTS[2], params, use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert len(cut.token_ids) < len(full.token_ids)
    assert cut.sampling_mask.token_ids == full.sampling_mask.token_ids[:len(cut.token_ids)]
    check_masks(cut, 3)


def test_streamed_outputs_carry_masks(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=7, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    engine.add_request("stream-0", PROMPTS[3], params)
    tokens: list[int] = []
    masks: list[list[int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            c = out.outputs[0]
            assert len(c.sampling_mask.token_ids) == len(c.token_ids)
            tokens += c.token_ids
            masks += c.sampling_mask.token_ids
    assert len(tokens) == len(masks) == 7
    assert all(t in m for t, m in zip(tokens, masks))


@pytest.mark.parametrize("bad", [dict(temperature=0.0, top_k=5), dict(temperature=1.0, top_k=0),
                                 dict(temperature=1.0, top_k=-1)])
def test_mask_request_rules(llm: LLM, bad: dict) -> None:
    with pytest.raises(ValueError, match="temperature|top_k"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=3, **bad), use_tqdm=False)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_k=2, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].sampling_mask.token_ids) == 3


def test_startup_validation() -> None:
    with pytest.raises(ValueError, match="processed_logprobs"):
        LLM(device="cpu", return_sampling_mask=True)
    with pytest.raises(ValueError, match="batch_sharded"):
        LLM(device="cpu", return_sampling_mask=True, logprobs_mode="processed_logprobs",
            enable_batch_sharded_sampling=True)
