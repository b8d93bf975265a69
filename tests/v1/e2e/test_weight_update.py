"""In-place weight updates on the bundled model (docs/rl.md): after an update, outputs equal those of a fresh
engine started on the new checkpoint (greedy token for token; seeded sampling token for token and mask for
mask), through the disk backend and the nccl backend (over gloo on CPU, the trainer in its own process, packed
and unpacked); a request paused in keep mode across the update records both weight versions; a refused update
leaves every weight bit-identical and the engine serving."""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_checkpoints import bundled_weights, perturbed_weights, write_checkpoint
from safetensors.torch import save_file

from vllm import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 300, 12]}, {"prompt_token_ids": list(range(40, 90))}]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_sampling_mask=False)
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
ENGINE = dict(device="cpu", max_num_seqs=8, max_model_len=256, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")


def _outputs(llm: LLM) -> list[tuple[list[int], list[list[int]] | None]]:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    return ([(o.outputs[0].token_ids, None) for o in greedy]
            + [(o.outputs[0].token_ids, o.outputs[0].sampling_mask.token_ids) for o in seeded])


def _params(llm: LLM) -> dict[str, torch.Tensor]:
    model = llm.llm_engine.engine_core.engine_core.worker.model_runner.model
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def new_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "new", perturbed_weights(), shards=3)


@pytest.fixture(scope="module")
def expected(new_checkpoint: Path) -> dict[str, Any]:
    """The reference: fresh engines on each checkpoint."""
    old = _outputs(LLM(**ENGINE))
    new = _outputs(LLM(str(new_checkpoint), **ENGINE))
    assert [t for t, _ in old] != [t for t, _ in new]  # the update must be visible
    return {"old": old, "new": new}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async_sched"])
def test_disk_update_equals_fresh_engine_and_spans_the_paused_request(
        async_scheduling: bool, new_checkpoint: Path, expected: dict[str, Any]) -> None:
    llm = LLM(**ENGINE, async_scheduling=async_scheduling, weight_transfer_config={"backend": "disk"})
    assert _outputs(llm) == expected["old"]
    engine = llm.llm_engine
    engine.add_request("across", PROMPTS[0], GREEDY)
    before = [o for _ in range(4) for o in engine.step()]
    engine.pause_generation(mode="keep", clear_cache=False)
    before += engine.step() + engine.step()
    llm.start_weight_update(is_checkpoint_format=True)
    llm.update_weights({"update_info": {"path": str(new_checkpoint)}})
    llm.finish_weight_update("step-1")
    assert llm.get_weight_version() == "step-1"
    engine.resume_generation()
    after = []
    while engine.has_unfinished_requests():
        after += engine.step()
    final = [o for o in before + after if o.finished][0].outputs[0]
    (old_version, start0, end0), (new_version, start1, end1) = final.weight_versions
    assert (old_version, new_version, start0, end1) == (None, "step-1", 0, GREEDY.max_tokens)
    assert end0 == start1 and 0 < end0 < GREEDY.max_tokens
    # The tokens computed before the update are the old engine's.
    assert final.token_ids[:end0] == expected["old"][0][0][:end0]
    assert _outputs(llm) == expected["new"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _update_info(weights: dict[str, torch.Tensor], **extra: Any) -> dict[str, Any]:
    names = sorted(weights)
    return {"names": names, "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(weights[n].shape) for n in names], **extra}


def _trainer(port: int, rounds: list[tuple[str, dict[str, Any]]]) -> None:
    """The trainer process: rank 0 of the weight group, sending one checkpoint per round."""
    from vllm.distributed.weight_transfer import NCCLWeightTransferEngine
    group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port,
                                                   "world_size": 2, "device": "cpu"})
    for which, args in rounds:
        weights = perturbed_weights() if which == "new" else bundled_weights()
        NCCLWeightTransferEngine.trainer_send_weights(iter(sorted(weights.items())), {"group": group, **args})


def test_nccl_update_over_gloo_packed_and_unpacked(expected: dict[str, Any]) -> None:
    llm = LLM(**ENGINE, weight_transfer_config={"backend": "nccl"})
    port = _free_port()
    packed = {"packed": True, "packed_buffer_size_bytes": 1 << 20, "packed_num_buffers": 2}
    rounds = [("new", packed), ("old", {"packed": False})]
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, rounds))
    trainer.start()
    try:
        llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                       "rank_offset": 1, "world_size": 2}})
        for (which, args), version in zip(rounds, ("v1", "v2")):
            weights = perturbed_weights() if which == "new" else bundled_weights()
            llm.start_weight_update()
            llm.update_weights({"update_info": _update_info(weights, **args)})
            llm.finish_weight_update(version)
            assert _outputs(llm) == expected[which]
    finally:
        trainer.join(60)
        if trainer.is_alive():
            trainer.kill()
    assert trainer.exitcode == 0


def _bad_update_folders(root: Path) -> dict[str, tuple[Path, str]]:
    weights = perturbed_weights()
    cases: dict[str, tuple[Path, str]] = {}
    empty = root / "empty"
    empty.mkdir()
    cases["no safetensors"] = (empty, "safetensors")
    unknown = dict(weights, **{"model.layers.0.self_attn.nope.weight": torch.zeros(3)})
    cases["unknown name"] = (write_checkpoint(root / "unknown", unknown), "nope.weight' matches no parameter")
    shape = dict(weights, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(512, 255)})
    cases["wrong shape"] = (write_checkpoint(root / "shape", shape), "shape \\[512, 255\\], the parameter needs")
    dtype = dict(weights, **{"model.norm.weight": torch.zeros(256, dtype=torch.int32)})
    cases["int dtype"] = (write_checkpoint(root / "dtype", dtype), "not a floating-point dtype")
    half = root / "half"
    half.mkdir()
    save_file({"model.norm.weight": weights["model.norm.weight"]}, str(half / "model.safetensors"))
    (half / "extra.txt").write_text("not weights")
    cases["missing folder"] = (root / "does-not-exist", "does-not-exist")
    return cases


def test_refused_updates_change_no_weight_and_the_engine_serves(tmp_path: Path, expected: dict[str, Any]) -> None:
    llm = LLM(**ENGINE, weight_transfer_config={"backend": "disk"})
    params = _params(llm)
    for what, (folder, message) in _bad_update_folders(tmp_path).items():
        llm.start_weight_update()
        with pytest.raises(ValueError, match=message):
            llm.update_weights({"path": str(folder)})
        llm.finish_weight_update()
        after = _params(llm)
        assert all(torch.equal(params[n], after[n]) for n in params), what
    with pytest.raises(ValueError, match="update_info must be an object"):
        llm.update_weights({"update_info": ["path"]})
    assert _outputs(llm) == expected["old"]
    with pytest.raises(ValueError, match="weight transfer backend must be one of"):
        LLM(**ENGINE, weight_transfer_config={"backend": "carrier-pigeon"})
    with pytest.raises(ValueError, match="unknown weight transfer config key"):
        LLM(**ENGINE, weight_transfer_config='{"backend": "disk", "speed": 9}')


def test_partial_update_in_model_format(expected: dict[str, Any]) -> None:
    """is_checkpoint_format=False takes the model's own (fused) parameter names: a partial update changes exactly
    the named parameters, to exactly the values sent (the fused qkv built by hand from the checkpoint's q, k, v)."""
    llm = LLM(**ENGINE, weight_transfer_config={"backend": "disk"})
    new = perturbed_weights()
    fused = {}
    for layer in range(2):
        prefix = f"model.layers.{layer}.self_attn."
        fused[prefix + "qkv_proj.weight"] = torch.cat([new[prefix + p + "_proj.weight"] for p in "qkv"])
    before = _params(llm)
    core = llm.llm_engine.engine_core.engine_core
    core.start_weight_update(is_checkpoint_format=False)
    core.worker.weight_updater._apply(_FakeEngine(fused), _FakeEngine(fused).info())
    core.finish_weight_update("fused")
    after = _params(llm)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == set(fused)
    for name, tensor in fused.items():
        assert torch.equal(after[name], tensor)


class _FakeEngine:
    """A transfer engine over tensors in memory (the model-format path of WeightUpdater, without a transport)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def info(self) -> Any:
        from types import SimpleNamespace
        names = sorted(self.tensors)
        return SimpleNamespace(names=names, dtype_names=["float32"] * len(names),
                               shapes=[tuple(self.tensors[n].shape) for n in names])

    def receive_weights(self, info: Any) -> Any:
        return ((n, self.tensors[n]) for n in info.names)


def test_framework_style_extension_loads_through_vllm_names(tmp_path: Path, expected: dict[str, Any]) -> None:
    """An extension importing vllm.config.set_current_vllm_config, vllm.model_executor.model_loader.utils.
    process_weights_after_loading and vllm.platforms.current_platform loads a checkpoint by collective_rpc, between
    two generate calls, and the engine then generates what a fresh engine on that checkpoint does."""
    from vllm.v1.worker.gpu_worker import Worker
    llm = LLM(**ENGINE, worker_extension_cls="rl_worker_ext.FrameworkStyleExtension")
    assert isinstance(llm.llm_engine.engine_core.engine_core.worker, Worker)
    folder = write_checkpoint(tmp_path / "single", perturbed_weights())
    # current_platform is the machine's (as in vLLM), not the engine's device: "cuda" on a GPU machine.
    platform = "cuda" if torch.cuda.is_available() else "cpu"
    assert llm.collective_rpc("fw_load_checkpoint", args=(str(folder),)) == [platform]
    assert _outputs(llm) == expected["new"]
