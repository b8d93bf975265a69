"""End-to-end offline generation through LLM: scheduler, runner, sampler and output processing together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
from hf_model_utils import make_hf_model  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The function", "A module is", "In Python, a list", "Return the", "class", "import os\n",
           "The default value of", "Raises an exception", "An integer", "The string", "If the", "for each",
           "Lists are", "Note that", "This is", "Example:"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_num_seqs=16, max_model_len=256)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers(tmp_path: Path, kind: str) -> None:
    hf = make_hf_model(kind, tmp_path, seed=3, tie_word_embeddings=(kind != "qwen3"))
    prompts = [[5, 17, 42, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    llm = LLM(str(tmp_path), device="cpu", skip_tokenizer_init=True, max_num_seqs=4, block_size=4,
              max_num_batched_tokens=8)  # forces chunked prefill of the longer prompt
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):]
        assert out.outputs[0].token_ids == ref.tolist()


def test_greedy_same_alone_and_in_batch(llm: LLM) -> None:
    alone = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0]
    batch = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert len(batch) == 16
    assert batch[0].outputs[0].token_ids == alone.token_ids
    assert batch[0].outputs[0].text == alone.text
    assert [o.prompt for o in batch] == PROMPTS


def test_greedy_unchanged_under_preemption(llm: LLM) -> None:
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:8], GREEDY, use_tqdm=False)]
    # 10 blocks of 4 tokens cannot hold 8 requests of ~16 tokens: the scheduler must preempt and recompute.
    small = LLM(device="cpu", max_num_seqs=8, max_model_len=32, block_size=4, num_gpu_blocks_override=10)
    sched = small.llm_engine.engine_core.engine_core.scheduler
    preempted: list[str] = []
    original = sched._preempt
    sched._preempt = lambda req: (preempted.append(req.request_id), original(req))[1]
    outs = small.generate(PROMPTS[:8], GREEDY, use_tqdm=False)
    assert preempted, "the KV budget was meant to force preemption"
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 10


def test_seeded_sampling_reproducible_and_batch_independent(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    mixed = llm.generate(PROMPTS[:6], [others, params, others, others, others, others], use_tqdm=False)
    assert a == b == mixed[1].outputs[0].token_ids
    c = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    assert c != a


def test_stop_conditions(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    stop_id = out.token_ids[2]
    first = out.token_ids.index(stop_id)
    out2 = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=[stop_id]),
                        use_tqdm=False)[0].outputs[0]
    assert out2.token_ids == out.token_ids[:first + 1]
    assert out2.finish_reason == "stop" and out2.stop_reason == stop_id
    text = out.text
    if len(text.strip()) > 3:
        stop = text.strip()[1:3]
        out3 = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, stop=[stop]),
                            use_tqdm=False)[0].outputs[0]
        assert out3.finish_reason == "stop" and out3.stop_reason == stop
        assert out3.text == text[:text.index(stop)]


def test_bad_request_leaves_engine_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="top_p"):
        llm.generate(PROMPTS[0], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="maximum model length"):
        llm.generate({"prompt_token_ids": [1] * 300}, GREEDY, use_tqdm=False)
    # One bad prompt among good ones: nothing is added.
    with pytest.raises(ValueError):
        llm.generate([PROMPTS[0], {"prompt_token_ids": [10**9]}], GREEDY, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert len(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)) == 2


def test_chat(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is a list?"}], GREEDY, use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template([{"role": "user", "content": "What is a list?"}], tokenize=True,
                                       add_generation_prompt=True)
    assert out.prompt_token_ids == list(expected)
    assert len(out.outputs[0].token_ids) == 12
