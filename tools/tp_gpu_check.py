"""Tensor parallelism on GPUs (for a machine with 2+ CUDA devices; the CPU tests cover the rest): TP=N against
TP=1 on the same checkpoint, greedy tokens and a seeded request's sampling masks, plus collective_rpc on every
rank and the time of a batch of decode steps. Prints one JSON line per TP size.

    python tools/tp_gpu_check.py --model /path/to/Qwen2.5-1.5B --tp 1 2 4 [--backend mp|ray] [--eager]

bf16: TP=N sums the row-parallel layers in another order, so tokens may part from TP=1 after a near tie; the line
reports how many of the prompts' greedy tokens agree (the first divergence per prompt) rather than asserting.
"""

from __future__ import annotations

import argparse
import json
import time


def run(model: str, tp: int, backend: str, eager: bool) -> dict:
    from vllm import LLM, SamplingParams
    llm = LLM(model, tensor_parallel_size=tp, distributed_executor_backend=backend if tp > 1 else None,
              max_model_len=1024, enforce_eager=eager, return_sampling_mask=True,
              logprobs_mode="processed_logprobs", gpu_memory_utilization=0.6)
    prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(16)]
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, return_sampling_mask=False)
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True)
    llm.generate(prompts[:2], greedy, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    out = llm.generate(prompts, greedy, use_tqdm=False)
    elapsed = time.perf_counter() - start
    masks = llm.generate(prompts[:4], seeded, use_tqdm=False)
    ranks = llm.collective_rpc("weight_info")
    result = {"tp": tp, "backend": backend, "greedy": [list(o.outputs[0].token_ids) for o in out],
              "seeded": [list(o.outputs[0].token_ids) for o in masks],
              "masks": [[list(m) for m in o.outputs[0].sampling_mask.token_ids] for o in masks],
              "num_ranks_answering": len(ranks), "greedy_batch_s": round(elapsed, 3)}
    llm.llm_engine.shutdown()
    return result


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--backend", default="mp", choices=["mp", "ray"])
    parser.add_argument("--eager", action="store_true")
    args = parser.parse_args()
    results = [run(args.model, tp, args.backend, args.eager) for tp in args.tp]
    base = results[0]
    for r in results:
        summary = {k: r[k] for k in ("tp", "backend", "num_ranks_answering", "greedy_batch_s")}
        summary["greedy_first_divergence"] = [first_divergence(a, b) for a, b in zip(r["greedy"], base["greedy"])]
        summary["seeded_equal"] = r["seeded"] == base["seeded"]
        summary["masks_equal"] = r["masks"] == base["masks"]
        summary["tokens_in_masks"] = all(t in m for s, ms in zip(r["seeded"], r["masks"]) for t, m in zip(s, ms))
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
