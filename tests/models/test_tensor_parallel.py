"""Whole models at tensor_parallel_size 2 and 4 (gloo, float32) against the same model at one rank.

Each rank loads the Hugging Face safetensors folder itself (its shard through the weight loaders) and runs a
prefill of two requests and a decode step over its own paged KV cache (the rank's KV heads); the logits must be
the one-rank logits. The cases cover GQA with fewer KV heads than ranks (llama, 2 KV heads at TP=4), MQA (qwen2,
one KV head, q/k/v biases) and per-head q/k norms with tied embeddings (qwen3); the vocabulary (160) is padded to
192 and split. Also: a weight update from disk (weight_update.py, checkpoint and model format) under TP equals the
one-rank model on the new weights, and dummy weights at TP=N are the slices of the one-rank dummy weights.
Every rank gets bit-identical logits, and the sampler run on them (seeded, top-k / top-p, sampling mask) draws
the tokens and masks of the one-rank model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from hf_model_utils import PagedRunner, make_hf_model
from safetensors.torch import save_file

from vllm.config.model import ModelConfig
from vllm.distributed import parallel_state as ps
from vllm.model_executor.model_loader import get_model
from vllm.utils import get_open_port

CPU = torch.device("cpu")
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa-bias": ("llama", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=False)),
    "qwen2-mqa": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen3-qk-norm-tied": ("qwen3", dict(head_dim=16, tie_word_embeddings=True)),
}
PROMPTS = {"a": [3, 17, 159, 96, 95, 40, 1], "b": [150, 0, 64, 97, 8]}  # ids on both sides of the slice edges
DECODE = {"a": [191 - 32], "b": [48]}


def _logits(path: str, tp: int, model: torch.nn.Module | None = None) -> torch.Tensor:
    """Prefill logits of every prompt token, then the decode step's: [12 + 2, vocab]."""
    mc = ModelConfig(model=path)
    model = model if model is not None else get_model(mc, CPU, torch.float32)
    runner = PagedRunner(model, mc.num_layers, mc.get_num_kv_heads(SimpleNamespace(tensor_parallel_size=tp)),
                         mc.head_size)
    return torch.cat([runner.step(PROMPTS, all_logits=True), runner.step(DECODE)])


def _sample(logits: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """Seeded top-k / top-p draws with sampling masks: (tokens, each row's mask ids)."""
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler
    n = logits.shape[0]
    md = SamplingMetadata(
        temperature=torch.tensor([1.0, 0.7] * (n // 2), dtype=torch.float32), all_greedy=False, all_random=True,
        top_p=torch.full((n,), 0.9), top_k=torch.full((n,), 20, dtype=torch.int32), min_p=None,
        generators={i: torch.Generator().manual_seed(100 + i) for i in range(n)}, max_top_k=20,
        sampling_mask_rows=torch.ones(n, dtype=torch.int32))
    out = Sampler("processed_logprobs")(logits, md)
    assert out.sampling_mask is not None
    lists = out.sampling_mask.tolists()
    masks = [lists.token_ids[lists.offsets[r]:lists.offsets[r + 1]].tolist() for r in range(n)]
    return out.sampled_token_ids.view(-1).tolist(), masks


def _member(rank: int, tp: int, port: int, data: dict[str, Any]) -> None:
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.v1.worker.weight_update import WeightUpdater
    ps.init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", backend="gloo")
    ps.initialize_model_parallel(tp)
    try:
        for name, path in data["paths"].items():
            logits = _logits(path, tp)
            assert logits.shape == data["logits"][name].shape, name
            torch.testing.assert_close(logits, data["logits"][name], atol=1e-5, rtol=1e-5, msg=name)
            every_rank = ps.tensor_model_parallel_all_gather(logits[None], dim=0)  # [tp, rows, vocab]
            assert all(torch.equal(every_rank[r], logits) for r in range(tp)), name
            assert _sample(logits) == data["samples"][name], name

        # Weight updates: disk checkpoint (HF names), then the model's own names (is_checkpoint_format=False).
        path_a, path_b = data["paths"]["llama-gqa-bias"], data["update_path"]
        model = get_model(ModelConfig(model=path_a), CPU, torch.float32)
        updater = WeightUpdater(model, SimpleNamespace(weight_transfer_config=WeightTransferConfig(backend="disk")),
                                CPU, rank)
        updater.load_from_disk(path_b)
        torch.testing.assert_close(_logits(path_a, tp, model), data["update_logits"], atol=1e-5, rtol=1e-5)
        updater.load_from_disk(path_a)
        torch.testing.assert_close(_logits(path_a, tp, model), data["logits"]["llama-gqa-bias"], atol=1e-5,
                                   rtol=1e-5)
        updater.start(is_checkpoint_format=False)
        updater.update({"path": data["model_format_path"]})
        updater.finish()
        torch.testing.assert_close(_logits(path_a, tp, model), data["update_logits"], atol=1e-5, rtol=1e-5)
        # The checks take the whole tensors' shapes (what a trainer sends), not this rank's shard.
        down = model.model.layers[0].mlp.down_proj.weight
        assert updater.weight_info()["model.layers.0.mlp.down_proj.weight"]["shape"] == [64, 128]
        updater.check(["model.layers.0.mlp.down_proj.weight"], ["float32"], [(64, 128)])
        with pytest.raises(ValueError, match="refused"):
            updater.check(["model.layers.0.mlp.down_proj.weight"], ["float32"], [tuple(down.shape)])
        with pytest.raises(ValueError, match="refused"):
            updater.check(["model.layers.0.self_attn.k_proj.weight"], ["float32"],
                          [tuple(model.model.layers[0].self_attn.qkv_proj.weight.shape)])

        # Dummy weights: this rank's shards are cut from the one-rank dummy tensors.
        qwen3 = data["paths"]["qwen3-qk-norm-tied"]
        dummy = get_model(ModelConfig(model=qwen3, load_format="dummy", seed=3), CPU, torch.float32)
        expected = get_model(ModelConfig(model=qwen3), CPU, torch.float32)
        expected.load_weights(data["dummy_state"].items())
        for (name, p), (_, q) in zip(dummy.named_parameters(), expected.named_parameters()):
            assert torch.equal(p, q), name
    finally:
        ps.destroy_distributed_environment()


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    paths: dict[str, str] = {}
    for name, (kind, overrides) in CASES.items():
        path = tmp_path_factory.mktemp(name)
        make_hf_model(kind, path, **overrides)
        paths[name] = str(path)
    update_path = tmp_path_factory.mktemp("llama-update")
    make_hf_model("llama", update_path, seed=1, **CASES["llama-gqa-bias"][1])
    model_b = get_model(ModelConfig(model=str(update_path)), CPU, torch.float32)
    model_format_path = tmp_path_factory.mktemp("llama-update-model-format")
    save_file({k: v.contiguous() for k, v in model_b.state_dict().items()}, str(model_format_path / "model.safetensors"))
    dummy_config = ModelConfig(model=paths["qwen3-qk-norm-tied"], load_format="dummy", seed=3)
    dummy = get_model(dummy_config, CPU, torch.float32)
    logits = {name: _logits(path, 1) for name, path in paths.items()}
    return {
        "paths": paths,
        "logits": logits,
        "samples": {name: _sample(x) for name, x in logits.items()},
        "update_path": str(update_path),
        "update_logits": _logits(paths["llama-gqa-bias"], 1, model_b),
        "model_format_path": str(model_format_path),
        "dummy_state": {k: v.clone() for k, v in dummy.named_parameters()},
    }


def test_one_rank_reference_is_not_trivial(data: dict[str, Any]) -> None:
    """The references differ between checkpoints and from zero, so equal logits at TP=N mean something."""
    for logits in data["logits"].values():
        assert logits.abs().max() > 0.1 and torch.isfinite(logits).all()
    for tokens, masks in data["samples"].values():
        assert all(t in m for t, m in zip(tokens, masks))
        assert len({len(m) for m in masks}) > 1 and all(1 <= len(m) <= 20 for m in masks)
    assert (data["update_logits"] - data["logits"]["llama-gqa-bias"]).abs().max() > 0.1


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_model_equals_one_rank(tp: int, data: dict[str, Any]) -> None:
    mp.spawn(_member, args=(tp, get_open_port(), data), nprocs=tp, join=True)
