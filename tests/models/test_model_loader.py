"""get_model and the registry: error paths, dummy weights, dtype handling, tied embeddings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_model_utils import TINY, PagedRunner, make_hf_model
from safetensors.torch import load_file, save_file

from vllm.config.model import ModelConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.model_loader import DUMMY_WEIGHT_RANGE, get_model
from vllm.model_executor.models.registry import get_model_class

CPU = torch.device("cpu")


def _edit_config(path: Path, **changes: object) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    config.update(changes)
    config_path.write_text(json.dumps(config))


def _write_config_only(path: Path, kind: str = "qwen3", **overrides: object) -> None:
    import transformers

    config_cls, arch = {"llama": (transformers.LlamaConfig, "LlamaForCausalLM"),
                        "qwen3": (transformers.Qwen3Config, "Qwen3ForCausalLM")}[kind]
    config_cls(architectures=[arch], **{**TINY, **overrides}).save_pretrained(path)


def _drop_weight(path: Path, name: str) -> None:
    tensors = load_file(path / "model.safetensors")
    del tensors[name]
    save_file(tensors, path / "model.safetensors")


def test_registry_resolves_first_supported_arch() -> None:
    assert get_model_class(["Qwen2ForCausalLM"]).__name__ == "Qwen2ForCausalLM"
    assert get_model_class(["FooModel", "Qwen3ForCausalLM"]).__name__ == "Qwen3ForCausalLM"


def test_unknown_architecture_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="FooForCausalLM") as info:
        get_model_class(["FooForCausalLM"])
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)
    _write_config_only(tmp_path)
    _edit_config(tmp_path, architectures=["BarForCausalLM"])
    with pytest.raises(ValueError, match="BarForCausalLM"):
        get_model(ModelConfig(model=str(tmp_path), load_format="dummy"), CPU, torch.float32)


@pytest.mark.parametrize("dropped, reported", [
    ("lm_head.weight", "lm_head.weight"),
    ("model.norm.weight", "model.norm.weight"),
    ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
    ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
])
def test_missing_weight_raises(tmp_path: Path, dropped: str, reported: str) -> None:
    make_hf_model("llama", tmp_path, tie_word_embeddings=False)
    _drop_weight(tmp_path, dropped)
    with pytest.raises(ValueError, match="missing") as info:
        get_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)
    assert reported in str(info.value)
    assert "model.embed_tokens.weight" not in str(info.value)


def test_unexpected_or_misshapen_weight_raises(tmp_path: Path) -> None:
    make_hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.extra.weight": torch.zeros(2)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="extra"):
        get_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    _edit_config(tmp_path, intermediate_size=96)
    with pytest.raises(ValueError, match="shape"):
        get_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)


def test_no_weights_file_raises(tmp_path: Path) -> None:
    _write_config_only(tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        get_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)


@pytest.mark.parametrize("rope", [{"rope_type": "longrope", "rope_theta": 10000.0, "factor": 2.0},
                                  {"type": "su", "factor": 2.0}])
def test_unsupported_rope_type_raises(tmp_path: Path, rope: dict) -> None:
    _write_config_only(tmp_path)
    _edit_config(tmp_path, rope_parameters=None, rope_scaling=rope)
    with pytest.raises(ValueError, match="rope_type"):
        get_model(ModelConfig(model=str(tmp_path), load_format="dummy"), CPU, torch.float32)


def test_dummy_weights_from_config_alone_are_deterministic(tmp_path: Path) -> None:
    _write_config_only(tmp_path, head_dim=32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    config = ModelConfig(model=str(tmp_path), load_format="dummy", seed=3)
    first, second = get_model(config, CPU, torch.float32), get_model(config, CPU, torch.float32)
    other = get_model(ModelConfig(model=str(tmp_path), load_format="dummy", seed=4), CPU, torch.float32)
    assert not first.training
    norm_weights = {id(m.weight) for m in first.modules() if isinstance(m, RMSNorm)}
    assert len(norm_weights) == 2 * 4 + 1  # 2 layers x (2 norms + q/k norms) + final norm
    for (name, p1), (_, p2), (_, p3) in zip(first.named_parameters(), second.named_parameters(),
                                            other.named_parameters()):
        torch.testing.assert_close(p1, p2, rtol=0, atol=0)
        if id(p1) in norm_weights:
            assert torch.all(p1 == 1), name
        else:
            assert p1.abs().max() <= DUMMY_WEIGHT_RANGE and p1.std() > DUMMY_WEIGHT_RANGE / 4, name
            assert not torch.equal(p1, p3), name
    prompt = list(range(1, 9))
    logits = PagedRunner(first, 2, 2, 32).step({"a": prompt}, all_logits=True)
    assert logits.shape == (8, TINY["vocab_size"]) and torch.isfinite(logits).all()


def test_dtype_applied_and_default_restored(tmp_path: Path) -> None:
    _write_config_only(tmp_path, kind="llama", tie_word_embeddings=True)
    before = torch.get_default_dtype()
    model = get_model(ModelConfig(model=str(tmp_path), load_format="dummy"), CPU, torch.bfloat16)
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    logits = PagedRunner(model, 2, 2, 16).step({"a": [1, 2, 3]})
    assert logits.dtype == torch.bfloat16 and logits.shape == (1, TINY["vocab_size"])


def test_tied_checkpoint_shares_embedding(tmp_path: Path) -> None:
    hf_model = make_hf_model("qwen2", tmp_path, tie_word_embeddings=True)
    model = get_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    torch.testing.assert_close(model.lm_head.weight, hf_model.lm_head.weight, rtol=0, atol=0)
