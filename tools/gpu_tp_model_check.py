"""GPU check of the tensor-parallel model side: TP=2 and TP=4 logits against TP=1 within bf16 tolerance.

Each TP size runs in its own processes (one per rank, torch.multiprocessing, NCCL on CUDA / gloo on CPU) joined
through vllm/distributed/parallel_state.py; no executor is involved. Every rank builds the Qwen2.5-1.5B config
(12 query heads, 2 KV heads: at TP=4 each KV head lives on two ranks) with dummy weights drawn in
[-0.05, 0.05] (a TP=N dummy model is the TP=1 one cut up, so the logits must agree), runs a varlen prefill of
several requests and then a decode step through the paged KV cache with the device's attention backend, and on
CUDA replays that decode step (the forward and compute_logits, with their all-reduces and the logits all-gather)
as a CUDA graph. Rank 0 writes its logits; the parent compares them with TP=1's (max relative L2 error per row,
argmax agreement) and the graph's with the eager step's, prints a report and exits non-zero on a mismatch.

    python tools/gpu_tp_model_check.py                      # TP 1, 2, 4 (as many as the GPUs allow), bf16
    python tools/gpu_tp_model_check.py --device cpu --model vllm/assets/tiny-llama --dtype float32 --tol 1e-4
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from vllm.config.model import ModelConfig
from vllm.distributed import parallel_state as ps
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model, initialize_dummy_weights
from vllm.utils import get_open_port
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.layer import set_attn_backend
from vllm.v1.attention.selector import get_attn_backend

QWEN_CONFIG = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs", "qwen2.5-1.5b-instruct")
PROMPT_LENS = [37, 5, 128, 1, 64, 17, 200, 9]
BLOCK_SIZE = 16


def _metadata(starts: list[int], ends: list[int], table: torch.Tensor, dev: torch.device
              ) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata of a step that computes tokens [start, end) of each request; also positions and logits rows."""
    pos = [torch.arange(s, e) for s, e in zip(starts, ends)]
    slots = torch.cat([table[i, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE for i, p in enumerate(pos)])
    qsl = torch.tensor([0] + [e - s for s, e in zip(starts, ends)], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    sl = torch.tensor(ends, dtype=torch.int32)
    md = AttentionMetadata(
        num_actual_tokens=int(qsl[-1]), num_reqs=len(ends), max_query_len=max(e - s for s, e in zip(starts, ends)),
        max_seq_len=max(ends), query_start_loc=qsl.to(dev), seq_lens=sl.to(dev), block_table=table.to(dev),
        slot_mapping=slots.to(dev), query_start_loc_cpu=qsl, seq_lens_cpu=sl)
    return md, torch.cat(pos).to(dev), (qsl[1:] - 1).long().to(dev)


def _rank(rank: int, tp: int, port: int, args: argparse.Namespace, out_path: str) -> None:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    ps.init_distributed_environment(tp, rank, f"tcp://127.0.0.1:{port}", local_rank=rank,
                                    backend="nccl" if cuda else "gloo")
    ps.initialize_model_parallel(tp)
    try:
        dtype = getattr(torch, args.dtype)
        mc = ModelConfig(model=args.model, load_format="dummy", max_model_len=1024)
        model = get_model(mc, dev, dtype)
        initialize_dummy_weights(model, seed=0, low=-args.weight_range, high=args.weight_range)
        set_attn_backend(model, get_attn_backend(dev))
        num_kv_heads = mc.num_kv_heads // tp if mc.num_kv_heads >= tp else 1
        blocks = [-(-(n + 1) // BLOCK_SIZE) for n in PROMPT_LENS]
        perm = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(0)).int()
        table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
        offset = 0
        for i, nb in enumerate(blocks):
            table[i, :nb] = perm[offset:offset + nb]
            offset += nb
        kv = [torch.zeros(2, sum(blocks), BLOCK_SIZE, num_kv_heads, mc.head_size, dtype=dtype, device=dev)
              for _ in range(mc.num_layers)]
        gen = torch.Generator().manual_seed(1)
        prompt_ids = torch.randint(0, mc.vocab_size, (sum(PROMPT_LENS),), generator=gen).to(dev)
        decode_ids = torch.randint(0, mc.vocab_size, (len(PROMPT_LENS),), generator=gen).to(dev)
        out: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            md, pos, rows = _metadata([0] * len(PROMPT_LENS), PROMPT_LENS, table, dev)
            with set_forward_context(md, kv):
                out["prefill"] = model.compute_logits(model(prompt_ids, pos)[rows]).float().cpu()
            md, pos, rows = _metadata(PROMPT_LENS, [n + 1 for n in PROMPT_LENS], table, dev)

            def decode() -> torch.Tensor:
                with set_forward_context(md, kv):
                    return model.compute_logits(model(decode_ids, pos))

            out["decode"] = decode().float().cpu()
            if cuda:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    decode()  # warm-up on the capture stream
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_logits = decode()
                graph.replay()
                torch.cuda.synchronize()
                out["decode_graph"] = static_logits.float().cpu()
        if rank == 0:
            torch.save(out, out_path)
    finally:
        ps.destroy_distributed_environment()


def _compare(name: str, actual: torch.Tensor, expected: torch.Tensor, tol: float) -> bool:
    rel = ((actual - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()
    agree = (actual.argmax(-1) == expected.argmax(-1)).float().mean().item()
    ok = actual.shape == expected.shape and rel < tol
    print(f"{name}: shape {tuple(actual.shape)}, max relative L2 error {rel:.2e}, argmax agreement {agree:.2f} "
          f"-> {'ok' if ok else 'MISMATCH'}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=QWEN_CONFIG, help="a folder with config.json (weights are dummy)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--weight-range", type=float, default=0.05)
    parser.add_argument("--tol", type=float, default=2e-2, help="largest relative L2 error of a logits row")
    args = parser.parse_args()
    sizes = [tp for tp in args.tp if args.device == "cpu" or tp <= torch.cuda.device_count()]
    skipped = sorted(set(args.tp) - set(sizes))
    if skipped:
        print(f"skipped TP {skipped}: only {torch.cuda.device_count()} GPUs")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        results: dict[int, dict[str, torch.Tensor]] = {}
        for tp in [1, *sizes]:
            path = os.path.join(tmp, f"tp{tp}.pt")
            mp.spawn(_rank, args=(tp, get_open_port(), args, path), nprocs=tp, join=True)
            results[tp] = torch.load(path)
        for tp, res in results.items():
            if "decode_graph" in res:
                same = torch.equal(res["decode_graph"], res["decode"])
                print(f"TP={tp}: decode step as a CUDA graph {'equals' if same else 'DIFFERS FROM'} the eager step")
                ok &= same
            if tp != 1:
                for step in ("prefill", "decode"):
                    ok &= _compare(f"TP={tp} vs TP=1, {step}", res[step], results[1][step], args.tol)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
