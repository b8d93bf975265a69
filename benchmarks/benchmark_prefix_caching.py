"""Prefix caching benchmark: GRPO groups and multi-turn sessions, offline (LLM) or served (`vllm serve`).

Workloads (random token-id prompts, ignore_eos, temperature 1):
- `grpo`: --num-groups G prompts of --prompt-len P tokens, each sampled --n N times (one request with n = N),
  --output-len R tokens each; with the cache the N children prefill the prompt about once instead of N times.
- `multi-turn`: --num-sessions S sessions of --turns T turns; turn t sends the session's whole history (the
  previous prompt, its output, then --turn-len U new user tokens) and gets --output-len R tokens; the sessions'
  turn t requests run together (offline: one batch per turn; served: each session a sequence of requests, all
  sessions at once).

Compare the cache on and off with two runs, the second with `--no-enable-prefix-caching` (offline) or against a
server started with it (served). Each run prints one table row: wall time, output tokens/s, total tokens/s
(prompt + output over wall time), and from the engine's prefix-cache counters the prompt tokens looked up, the
hits, the hit rate and the prompt tokens computed (looked up - hit). Offline the counters are read from the
engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, the default; "-" otherwise); served, from
/metrics (vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total) before and after the run.

Examples (the issue's shapes; dummy weights):
    python benchmarks/benchmark_prefix_caching.py --model benchmarks/configs/qwen2.5-1.5b-instruct \
        --load-format dummy --workload grpo --num-groups 64 --prompt-len 2048 --n 8 --output-len 256
    python benchmarks/benchmark_prefix_caching.py ... --no-enable-prefix-caching
    python benchmarks/benchmark_prefix_caching.py --base-url http://127.0.0.1:8000 --workload multi-turn \
        --num-sessions 32 --turns 8 --turn-len 256 --output-len 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from vllm.engine.arg_utils import EngineArgs


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser, positional_model=False)
    parser.add_argument("--workload", choices=["grpo", "multi-turn"], default="grpo")
    parser.add_argument("--num-groups", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--num-sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--base-url", default=None, help="Run against this `vllm serve` instead of offline.")
    parser.add_argument("--json-out", default=None)
    return parser


class Workload:
    """The prompts of the run, drawn from one seeded generator: GRPO prompts, or each session's user turns."""

    def __init__(self, args: argparse.Namespace, vocab_size: int) -> None:
        self.args = args
        rng = np.random.default_rng(args.seed)
        # NOTE: ids from 10 up: clear of the usual special tokens of small vocabularies.
        draw = lambda n: rng.integers(10, vocab_size, n).tolist()  # noqa: E731
        self.grpo_prompts = [draw(args.prompt_len) for _ in range(args.num_groups)]
        self.user_turns = [[draw(args.turn_len) for _ in range(args.turns)] for _ in range(args.num_sessions)]


def _row(args: argparse.Namespace, elapsed: float, prompt_tokens: int, output_tokens: int,
         counters: tuple[int, int] | None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "workload": args.workload,
        # Served: whatever the server was started with (None: "server").
        "prefix_caching": None if args.base_url else args.enable_prefix_caching is not False,
        "elapsed_s": elapsed, "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / elapsed, "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "queries": None, "hits": None, "hit_rate": None, "prompt_tokens_computed": None}
    if counters is not None:
        queries, hits = counters
        row.update(queries=queries, hits=hits, hit_rate=hits / queries if queries else 0.0,
                   prompt_tokens_computed=queries - hits)
    return row


def print_row(row: dict[str, Any]) -> None:
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print("| workload | cache | elapsed (s) | output tok/s | total tok/s | prompt tok | looked up | hits | hit rate "
          "| prompt tok computed |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    cache = {None: "server", True: "on", False: "off"}[row["prefix_caching"]]
    print(f"| {row['workload']} | {cache} | {row['elapsed_s']:.2f} | "
          f"{row['output_tokens_per_s']:.0f} | {row['total_tokens_per_s']:.0f} | {row['prompt_tokens']} | "
          f"{fmt(row['queries'], 'd')} | {fmt(row['hits'], 'd')} | {fmt(row['hit_rate'], '.3f')} | "
          f"{fmt(row['prompt_tokens_computed'], 'd')} |")


# ---------------------------------------------------------------------------------------------- offline


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.max_model_len is None:
        longest = (args.prompt_len if args.workload == "grpo"
                   else args.turns * (args.turn_len + args.output_len))
        engine_args.max_model_len = longest + args.output_len + 16
    llm = LLM(**vars(engine_args))
    work = Workload(args, llm.llm_engine.vllm_config.model_config.vocab_size)
    counters = _engine_counters(llm)
    params = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=args.seed)
    # Warm-up on prompts of their own (nothing the run will hit).
    warm = np.random.default_rng(args.seed + 1).integers(10, 100, (2, 16)).tolist()
    llm.generate([{"prompt_token_ids": p} for p in warm], params.clone(), use_tqdm=False)
    llm.reset_prefix_cache()
    start_counts = counters() if counters else None
    start = time.perf_counter()
    prompt_tokens = output_tokens = 0
    if args.workload == "grpo":
        group = params.clone()
        group.n = args.n
        outs = llm.generate([{"prompt_token_ids": p} for p in work.grpo_prompts], group, use_tqdm=False)
        prompt_tokens = args.n * sum(map(len, work.grpo_prompts))
        output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    else:
        histories: list[list[int]] = [[] for _ in range(args.num_sessions)]
        for t in range(args.turns):
            batch = [h + work.user_turns[s][t] for s, h in enumerate(histories)]
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            for s, out in enumerate(outs):
                histories[s] = batch[s] + list(out.outputs[0].token_ids)
                prompt_tokens += len(batch[s])
                output_tokens += len(out.outputs[0].token_ids)
    elapsed = time.perf_counter() - start
    end_counts = counters() if counters else None
    diff = None if start_counts is None or end_counts is None else (
        end_counts[0] - start_counts[0], end_counts[1] - start_counts[1])
    return _row(args, elapsed, prompt_tokens, output_tokens, diff)


def _engine_counters(llm: Any) -> Callable[[], tuple[int, int]] | None:
    """A reader of the in-process engine core's prefix-cache queries and hits since start (None when the engine
    core runs in its own process): it wraps the scheduler's make_stats, which hands them out once per step."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return None
    sched = core.scheduler
    totals = [0, 0]
    make_stats = sched.make_stats

    def counting(*a: Any) -> Any:
        stats = make_stats(*a)
        totals[0] += stats.prefix_cache_queries
        totals[1] += stats.prefix_cache_hits
        return stats

    sched.make_stats = counting
    return lambda: (totals[0], totals[1])


# ---------------------------------------------------------------------------------------------- served


_COUNTER = re.compile(r"^vllm:prefix_cache_(queries|hits)_total\{[^}]*\} ([0-9.e+]+)$", re.MULTILINE)


async def _served(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = args.base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        model = (await client.get(f"{base}/v1/models")).json()["data"][0]["id"]
        vocab = args.vocab_size

        async def counters() -> tuple[int, int] | None:
            resp = await client.get(f"{base}/metrics")
            found: dict[str, int] = {}
            for k, v in _COUNTER.findall(resp.text) if resp.status_code == 200 else ():
                found[k] = found.get(k, 0) + int(float(v))  # NOTE: summed over the engines (engine="i")
            return (found["queries"], found["hits"]) if len(found) == 2 else None

        work = Workload(args, vocab)

        async def complete(prompt: list[int], n: int) -> list[list[int]]:
            body = {"model": model, "prompt": prompt, "n": n, "max_tokens": args.output_len, "temperature": 1.0,
                    "ignore_eos": True, "return_token_ids": True}
            resp = await client.post(f"{base}/v1/completions", json=body)
            resp.raise_for_status()
            return [c["token_ids"] for c in sorted(resp.json()["choices"], key=lambda c: c["index"])]

        async def session(s: int) -> tuple[int, int]:
            history: list[int] = []
            sent = got = 0
            for t in range(args.turns):
                prompt = history + work.user_turns[s][t]
                out = (await complete(prompt, 1))[0]
                history = prompt + out
                sent, got = sent + len(prompt), got + len(out)
            return sent, got

        before = await counters()
        start = time.perf_counter()
        if args.workload == "grpo":
            outs = await asyncio.gather(*(complete(p, args.n) for p in work.grpo_prompts))
            prompt_tokens = args.n * sum(map(len, work.grpo_prompts))
            output_tokens = sum(len(c) for o in outs for c in o)
        else:
            totals = await asyncio.gather(*(session(s) for s in range(args.num_sessions)))
            prompt_tokens, output_tokens = sum(t[0] for t in totals), sum(t[1] for t in totals)
        elapsed = time.perf_counter() - start
        after = await counters()
    diff = None if before is None or after is None else (after[0] - before[0], after[1] - before[1])
    return _row(args, elapsed, prompt_tokens, output_tokens, diff)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    parser.add_argument("--vocab-size", type=int, default=1000,
                        help="Served runs: prompt ids are drawn below this (the server's vocabulary size or less).")
    args = parser.parse_args(argv)
    row = asyncio.run(_served(args)) if args.base_url else run_offline(args)
    print_row(row)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if _jsonable(v)}, "result": row}, f, indent=2)
    return row


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except TypeError:
        return False


if __name__ == "__main__":
    main()
