"""Offline throughput: N requests of random token-id prompts through LLM.generate, fixed output length;
`--async-engine` (vLLM's flag): through an AsyncLLM in this process instead, all N requests at once with FINAL_ONLY
outputs, the engine core in its own process (as RL frameworks embed it).

Example (the GPU issue's shape, dummy weights):
    python benchmarks/benchmark_throughput.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --num-prompts 512 --input-len 128 --output-len 256 --max-num-seqs 512

With `--return-sampling-mask` (and `--logprobs-mode processed_logprobs`) every request gets its masks, and the
run checks that each output token came with one mask of at least one id (`masks` column: ok, or how many
requests were off).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable

import numpy as np

from vllm import LLM, RequestOutput, RequestOutputKind, SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs


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
    parser.add_argument("--flat-logprobs", action="store_true", help="SamplingParams(flat_logprobs=True)")
    parser.add_argument("--async-engine", action="store_true",
                        help="An AsyncLLM in this process (engine core in its own) instead of the LLM class")
    args = parser.parse_args()
    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len is None:
        engine_args.max_model_len = args.input_len + args.output_len + 16
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            logprobs=args.logprobs, max_tokens=args.output_len, ignore_eos=True,
                            flat_logprobs=args.flat_logprobs)
    if args.async_engine:
        generate, vocab, close = async_generate(engine_args, params)
    else:
        llm = LLM(**{k: v for k, v in vars(engine_args).items()})
        vocab = llm.llm_engine.vllm_config.model_config.vocab_size

        def generate(batch: list[dict]) -> list[RequestOutput]:
            return llm.generate(batch, params, use_tqdm=False)

        def close() -> None:
            pass

    rng = np.random.default_rng(0)

    def prompts(n: int) -> list[dict]:
        return [{"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()} for _ in range(n)]

    try:
        results = run_levels(generate, prompts, args, engine_args)
    finally:
        close()
    print(f"| requests | elapsed (s) | output tok/s | req/s | masks |\n|---:|---:|---:|---:|---|")
    for r in results:
        masks = "-" if r["masks_bad"] is None else ("ok" if r["masks_bad"] == 0 else f"{r['masks_bad']} bad")
        print(f"| {r['num_prompts']} | {r['elapsed_s']:.2f} | {r['output_tokens_per_s']:.0f} | "
              f"{r['requests_per_s']:.2f} | {masks} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


def async_generate(engine_args: EngineArgs, params: SamplingParams
                   ) -> tuple[Callable[[list[dict]], list[RequestOutput]], int, Callable[[], None]]:
    """(generate(batch), vocabulary size, close()) over an AsyncLLM in this process: each batch's requests are
    added at once and awaited together on one event loop, kept for all batches."""
    from vllm import AsyncLLMEngine

    runner = asyncio.Runner()
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**vars(engine_args)))
    final = params.clone()
    final.output_kind = RequestOutputKind.FINAL_ONLY
    batches = iter(range(1 << 62))

    async def one(request_id: str, prompt: dict) -> RequestOutput:
        last = None
        async for out in engine.generate(prompt, final, request_id):
            last = out
        assert last is not None and last.finished
        return last

    def generate(batch: list[dict]) -> list[RequestOutput]:
        b = next(batches)

        async def all_of() -> list[RequestOutput]:
            return list(await asyncio.gather(*(one(f"{b}-{i}", p) for i, p in enumerate(batch))))

        return runner.run(all_of())

    def close() -> None:
        engine.shutdown()
        runner.close()

    return generate, engine.model_config.vocab_size, close


def run_levels(generate: Callable[[list[dict]], list[RequestOutput]], prompts: Callable[[int], list[dict]],
               args: argparse.Namespace, engine_args: EngineArgs) -> list[dict]:
    generate(prompts(args.warmup_prompts))
    results = []
    for n in args.num_prompts:
        batch = prompts(n)
        start = time.perf_counter()
        outs = generate(batch)
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
    return results


if __name__ == "__main__":
    main()
