"""Offline throughput: N requests of random token-id prompts through LLM.generate, fixed output length.

Example (the GPU issue's shape, dummy weights):
    python benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --num-prompts 512 --input-len 128 --output-len 256 --max-num-seqs 512

With `--return-sampling-mask` (and `--logprobs-mode processed_logprobs`) every request gets its masks, and the
run checks that each output token came with one mask of at least one id (`masks` column: ok, or how many
requests were off).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from vllm import LLM, SamplingParams
from vllm.engine.arg_utils import EngineArgs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--num-prompts", type=int, nargs="+", default=[64])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--warmup-prompts", type=int, default=8)
    parser.add_argument("--json-out", type=str, default=None)
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = args.input_len + args.output_len + 16
    llm = LLM(**{k: v for k, v in vars(engine_args).items()})
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            logprobs=args.logprobs, max_tokens=args.output_len, ignore_eos=True)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(n)]

    llm.generate(prompts(args.warmup_prompts), params, use_tqdm=False)
    results = []
    for n in args.num_prompts:
        batch = prompts(n)
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        masks_bad = None
        if engine_args.return_sampling_mask:
            # One mask per output token, none empty (outside the timed part).
            masks_bad = sum(c.sampling_mask is None or len(c.sampling_mask) != len(c.token_ids)
                            or not (c.sampling_mask.counts > 0).all() for o in outs for c in o.outputs)
        results.append({"num_prompts": n, "elapsed_s": elapsed, "output_tokens": num_out,
                        "output_tokens_per_s": num_out / elapsed, "requests_per_s": n / elapsed,
                        "masks_bad": masks_bad})
    print(f"| requests | elapsed (s) | output tok/s | req/s | masks |\n|---:|---:|---:|---:|---|")
    for r in results:
        masks = "-" if r["masks_bad"] is None else ("ok" if r["masks_bad"] == 0 else f"{r['masks_bad']} bad")
        print(f"| {r['num_prompts']} | {r['elapsed_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
              f"{r['requests_per_s']:.2f} | {masks} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
