"""Llama / Qwen2 / Qwen3 against Hugging Face transformers on tiny random float32 checkpoints.

Each case is saved by transformers and loaded through get_model; prefill logits must match HF's forward, and
greedy decoding through the paged KV cache (chunked prefill, two requests batched, shuffled blocks) must
match HF's greedy generate token for token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_model_utils import PagedRunner, make_hf_model

from vllm.config.model import ModelConfig
from vllm.model_executor.model_loader import get_model

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-llama3-rope": ("llama", dict(rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "llama-linear-rope-bias": ("llama", dict(attention_bias=True, mlp_bias=True, rope_parameters=dict(
        rope_type="linear", rope_theta=500000.0, factor=2.0))),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3-sharded": ("qwen3", dict(head_dim=32, tie_word_embeddings=False, max_shard_size="40KB")),
    "qwen3-yarn": ("qwen3", dict(head_dim=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=1000000.0, factor=4.0, original_max_position_embeddings=32))),
}


def _legacy_rope_config(path: Path) -> None:
    """Rewrite config.json the way transformers 4 wrote it: top-level rope_theta, rope_scaling with `type`."""
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config["rope_scaling"] = rope
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module", params=[*CASES, "llama-llama3-rope-legacy-config"])
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    legacy = request.param.endswith("-legacy-config")
    kind, overrides = CASES[request.param.removesuffix("-legacy-config")]
    overrides = dict(overrides)
    max_shard_size = overrides.pop("max_shard_size", None)
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_hf_model(kind, path, max_shard_size=max_shard_size, **overrides)
    if max_shard_size:
        assert (path / "model.safetensors.index.json").exists()
        assert len(list(path.glob("*.safetensors"))) > 1
    if legacy:
        _legacy_rope_config(path)
    model_config = ModelConfig(model=str(path))
    model = get_model(model_config, torch.device("cpu"), torch.float32)
    return hf_model, model, model_config


def _runner(model: torch.nn.Module, model_config: ModelConfig) -> PagedRunner:
    return PagedRunner(model, model_config.num_layers, model_config.num_kv_heads, model_config.head_size)


def test_prefill_logits_match_hf(models) -> None:
    hf_model, model, model_config = models
    prompt = torch.randint(0, model_config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0]  # [13, V]
    logits = _runner(model, model_config).step({"a": prompt.tolist()}, all_logits=True)
    assert logits.shape == expected.shape and logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)


def test_greedy_paged_decode_matches_hf_generate(models) -> None:
    hf_model, model, model_config = models
    gen = torch.Generator().manual_seed(2)
    prompts = {"a": torch.randint(0, model_config.vocab_size, (7,), generator=gen).tolist(),
               "b": torch.randint(0, model_config.vocab_size, (10,), generator=gen).tolist()}
    num_new = 16
    expected = {}
    for req_id, prompt in prompts.items():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False)
        expected[req_id] = out[0, len(prompt):].tolist()

    runner = _runner(model, model_config)
    generated: dict[str, list[int]] = {"a": [], "b": []}
    # Step 1: all of a's prompt, the first 6 tokens of b's (chunked prefill).
    logits = runner.step({"a": prompts["a"], "b": prompts["b"][:6]})
    generated["a"].append(int(logits[0].argmax()))
    # Step 2: a decodes while b finishes its prefill.
    logits = runner.step({"a": generated["a"][-1:], "b": prompts["b"][6:]})
    generated["a"].append(int(logits[0].argmax()))
    generated["b"].append(int(logits[1].argmax()))
    while len(generated["b"]) < num_new:
        chunks = {r: toks[-1:] for r, toks in generated.items() if len(toks) < num_new}
        logits = runner.step(chunks)
        for i, req_id in enumerate(chunks):
            generated[req_id].append(int(logits[i].argmax()))
    assert generated == expected
