"""Time in-place weight updates of a running engine (docs/rl.md) and its throughput before and after them.

    python benchmarks/benchmark_weight_update.py --model benchmarks/configs/qwen2.5-1.5b-instruct

On a model with dummy weights (CUDA): writes the model's weights as a Hugging Face checkpoint (bf16 safetensors,
~1 GB shards) under --ckpt-dir, reads it once so it is in the page cache, then times
- disk: start_weight_update + a load of the folder + finish_weight_update, from the page cache (the path of
  prime-rl's /update_weights {"weight_dir"}, whatever the configured backend);
- ipc (the engine's backend): start + update_weights with CUDA IPC handles from a second process on the same GPU
  (it allocates the tensors and lends them; the time starts when the engine has the handles) + finish;
each --rounds times, and the offline generation throughput (masks on) before any update and after the last
one: the update copies into the existing parameters, so the captured CUDA graphs serve unchanged. After the
IPC update a few parameters are compared with the lent tensors (checksums from the trainer).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch


def checkpoint_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's parameters under their checkpoint (Hugging Face) names: fused qkv / gate_up split back."""
    mapping = getattr(model, "stacked_params_mapping", [])
    for name, param in model.named_parameters():
        offsets = getattr(model.get_submodule(name.rsplit(".", 1)[0]), "shard_offsets", None)
        if offsets is None:
            yield name, param.data
            continue
        for fused, ckpt, shard in mapping:
            if fused + "." in name and shard in offsets:
                start, size = offsets[shard]
                yield name.replace(fused + ".", ckpt + "."), param.data.narrow(0, start, size)


def write_checkpoint(model: torch.nn.Module, folder: str, shard_bytes: int = 1 << 30) -> int:
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size, total, index = 0, 0, 0
    for name, tensor in checkpoint_tensors(model):
        # NOTE: other values than the engine holds (x 1.01), so that an update really writes every parameter.
        shard[name] = (tensor.float() * 1.01).to(torch.bfloat16).cpu().contiguous()
        size += shard[name].numel() * 2
        if size >= shard_bytes:
            save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))
            total, shard, size, index = total + size, {}, 0, index + 1
    if shard:
        save_file(shard, os.path.join(folder, f"model-{index:05d}.safetensors"))
        total += size
    return total


def warm_page_cache(folder: str) -> None:
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as f:
            while f.read(64 << 20):
                pass


def ipc_trainer(shapes: list[tuple[str, list[int]]], conn: Any, rounds: int) -> None:
    """Second process on the same GPU: per round, fresh bf16 tensors lent by IPC handles; checksums for the
    check; it keeps them alive until the engine says it copied them."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine, encode_ipc_handles
    torch.cuda.set_device(0)
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(rounds):
        tensors = [(n, torch.randn(s, device="cuda", generator=generator).mul_(0.02).to(torch.bfloat16))
                   for n, s in shapes]
        torch.cuda.synchronize()
        info, keep = IPCWeightTransferEngine.trainer_update_info(iter(tensors))
        sums = {n: float(t.double().sum()) for n, t in tensors[:4] + tensors[-4:]}
        conn.send(({"names": info.names, "dtype_names": info.dtype_names, "shapes": [list(s) for s in info.shapes],
                    "ipc_handles_pickled": encode_ipc_handles(info.ipc_handles)}, sums))
        assert conn.recv() == "copied"
        del keep, tensors
        torch.cuda.ipc_collect()
    conn.close()


def throughput(llm: Any, prompts: list[dict[str, Any]], params: Any) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/qwen2.5-1.5b-instruct")
    parser.add_argument("--ckpt-dir", default="/tmp/weight-update-ckpt")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=args.num_prompts,
              max_model_len=args.input_len + args.output_len + 16, return_sampling_mask=True,
              logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "ipc"})
    model = llm.llm_engine.engine_core.engine_core.worker.model_runner.model
    vocab = int(model.config.vocab_size)
    generator = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.input_len,), generator=generator).tolist()}
               for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, max_tokens=args.output_len, ignore_eos=True,
                            logprobs=1)
    throughput(llm, prompts, params)  # warm-up: the sampler graphs of every batch size are captured here
    runner = llm.llm_engine.engine_core.engine_core.worker.model_runner

    def graph_ids() -> list[int]:
        """Identities of every captured CUDA graph (forward, mixed, sampler): unchanged by an update."""
        managers = [runner.cudagraphs.graphs, runner.mixed_graphs.graphs,
                    runner.sampler_graphs.graphs if runner.sampler_graphs is not None else {}]
        return sorted(id(g) for m in managers for g, _ in m.values())

    graphs_before = graph_ids()
    result: dict[str, Any] = {"tokens_per_s_before": [throughput(llm, prompts, params) for _ in range(2)]}

    nbytes = write_checkpoint(model, args.ckpt_dir)
    warm_page_cache(args.ckpt_dir)
    result["checkpoint_gb"] = nbytes / 1e9
    disk = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        # NOTE: the engine-core call behind prime-rl's /update_weights {"weight_dir"} (start, load, finish).
        llm.llm_engine.engine_core.call_utility("load_weights_from_disk", os.path.abspath(args.ckpt_dir), "disk")
        disk.append(time.perf_counter() - t0)
    result["disk_s"] = disk

    shapes = [(n, list(t.shape)) for n, t in checkpoint_tensors(model)]
    parent, child = multiprocessing.get_context("spawn").Pipe()
    trainer = multiprocessing.get_context("spawn").Process(target=ipc_trainer, args=(shapes, child, args.rounds))
    trainer.start()
    llm.init_weight_transfer_engine({})
    ipc, mismatches = [], 0
    for i in range(args.rounds):
        update_info, sums = parent.recv()
        t0 = time.perf_counter()
        llm.start_weight_update()
        llm.update_weights(update_info)
        llm.finish_weight_update(f"ipc-{i}")
        ipc.append(time.perf_counter() - t0)
        params_now = dict(checkpoint_tensors(model))
        mismatches += sum(abs(float(params_now[n].double().sum()) - s) > 1e-3 * max(1.0, abs(s))
                          for n, s in sums.items())
        parent.send("copied")
    trainer.join(60)
    result["ipc_s"] = ipc
    result["ipc_checksum_mismatches"] = mismatches
    result["tokens_per_s_after"] = [throughput(llm, prompts, params) for _ in range(2)]
    result["num_graphs"] = len(graphs_before)
    result["graphs_unchanged"] = graph_ids() == graphs_before
    result["after_over_before"] = statistics.median(result["tokens_per_s_after"]) / statistics.median(
        result["tokens_per_s_before"])
    result["device"] = torch.cuda.get_device_name()
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
