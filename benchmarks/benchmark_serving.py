"""HTTP load generator for `vllm serve`: /v1/completions (streamed by default), /v1/chat/completions or
/inference/v1/generate (`--endpoint`; `--no-stream` for one JSON body per request, as RL clients read them) of
random token-id prompts, fixed output length.

For each concurrency in --concurrency, sends --num-prompts requests (default: max(concurrency, 128)) while keeping
`concurrency` of them in flight, optionally spread over several client processes so that the client is never the
bottleneck. Reports per concurrency: output tokens/s, requests/s, TTFT and TPOT (median, p99), the wall time, and,
when the server returns sampling masks, whether every request received exactly one mask per generated token.

Example:
    python benchmarks/benchmark_serving.py --base-url http://127.0.0.1:8000 --concurrency 64 256 \
        --input-len 128 --output-len 256 --temperature 1 --top-p 0.95 --top-k 512 --logprobs 1 --json-out out.json

Invariants:
- A request's output token count is the `usage.completion_tokens` of its final stream chunk (stream_options
  include_usage) or of its body (`--no-stream`); the per-chunk count (token_ids, logprobs tokens or masks) is used
  for requests cut short by --level-timeout and is cross-checked against usage otherwise.
- `--no-stream`: the body is read whole and accounted as one event (its choices and usage, the masks counted as
  in a stream); a request's first token is then its whole body (TTFT = its latency, TPOT not meaningful). The
  chat endpoint's prompt is the prompt ids written as "<id>" words (`prompt_field`): what the A/B's synthetic
  tokenizer (ab_sampling_mask.write_id_tokenizer) reads back as those ids; the server needs a tokenizer for
  chat. Non-streamed requests ask for `return_token_ids` (generate returns them anyway).
- Throughput = output tokens received (including those of requests cut short) / wall time of the level.
- All timestamps are `time.time()` so records from several client processes share one clock.
- `--mask-check parse` (default) decodes every mask into Python lists, as a generic JSON client does;
  `--mask-check count` decodes each token's mask as raw JSON (msgspec.Raw: validated, not turned into hundreds
  of Python ints per token) and counts its ids by its commas, for the same counts at a fraction of the client's
  CPU (the load generator shares the server's machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np

from serving_metrics import MASK_CHECKS, RequestRecord, _handle_event, markdown_table, summarize

try:
    import aiohttp
except ImportError:  # the bench extra installs it; httpx is the fallback
    aiohttp = None


def parse_cpu_list(text: str) -> set[int]:
    """CPU numbers of a list like taskset's ("0-3,8,10-11")."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"no CPU in {text!r}")
    return cpus


@dataclass
class LevelSpec:
    """One client process's share of a level: its prompts, payload fields and timing."""

    url: str
    payload: dict[str, Any]
    prompts: list[list[int]]
    concurrency: int
    start_at: float
    deadline: float
    headers: dict[str, str] = field(default_factory=dict)
    mask_check: str = "parse"
    # The CPUs the client process runs on (None: any).
    cpus: list[int] | None = None
    endpoint: str = "completions"
    stream: bool = True


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "generate": "/inference/v1/generate"}


def prompt_field(endpoint: str, prompt: list[int]) -> dict[str, Any]:
    """The request fields that carry `prompt` to `endpoint`."""
    if endpoint == "chat":
        return {"messages": [{"role": "user", "content": "".join(f"<{i}>" for i in prompt)}]}
    return {"token_ids" if endpoint == "generate" else "prompt": prompt}


async def _stream_one(client: Any, spec: LevelSpec, prompt: list[int], rec: RequestRecord) -> None:
    payload = {**spec.payload, **prompt_field(spec.endpoint, prompt)}
    rec.start = time.time()
    if not spec.stream:
        await _whole_one(client, spec, payload, rec)
        return
    if aiohttp is not None and isinstance(client, aiohttp.ClientSession):
        async with client.post(spec.url, json=payload, headers=spec.headers) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return
            async for raw in resp.content:
                line = raw.strip()
                if line.startswith(b"data: ") and _handle_event(line[6:], rec, spec.mask_check):
                    break
    else:
        async with client.stream("POST", spec.url, json=payload, headers=spec.headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                rec.error = f"HTTP {resp.status_code}: {body[:300]}"
                return
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and _handle_event(line[6:], rec, spec.mask_check):
                    break
    rec.end = time.time()


async def _whole_one(client: Any, spec: LevelSpec, payload: dict[str, Any], rec: RequestRecord) -> None:
    """A non-streamed request: its body read whole, then accounted as one event."""
    if aiohttp is not None and isinstance(client, aiohttp.ClientSession):
        async with client.post(spec.url, json=payload, headers=spec.headers) as resp:
            status, body = resp.status, await resp.read()
    else:
        resp = await client.post(spec.url, json=payload, headers=spec.headers)
        status, body = resp.status_code, resp.content
    rec.first_token = time.time()
    if status != 200:
        rec.error = f"HTTP {status}: {body[:300].decode(errors='replace')}"
        return
    _handle_event(body, rec, spec.mask_check)
    rec.end = time.time()


def _make_client(concurrency: int) -> Any:
    """aiohttp (C parser) when installed, else httpx; either way no limit below the level's concurrency."""
    if aiohttp is not None:
        # NOTE: a merged chunk with sampling masks can be megabytes on one SSE line.
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency + 8),
                                     timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 24)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    return httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits, trust_env=False)


async def _run_share(spec: LevelSpec) -> list[RequestRecord]:
    records = [RequestRecord() for _ in spec.prompts]
    next_index = 0

    async with _make_client(spec.concurrency) as client:
        async def worker() -> None:
            nonlocal next_index
            while next_index < len(spec.prompts):
                i = next_index
                next_index += 1
                try:
                    await _stream_one(client, spec, spec.prompts[i], records[i])
                except asyncio.CancelledError:
                    records[i].error = "timeout"
                    raise
                except Exception as e:  # noqa: BLE001 - recorded per request, the level goes on
                    records[i].error = f"{type(e).__name__}: {e}"[:300]
                finally:
                    if records[i].end is None:
                        records[i].end = time.time()

        await asyncio.sleep(max(0.0, spec.start_at - time.time()))
        tasks = [asyncio.create_task(worker()) for _ in range(min(spec.concurrency, len(spec.prompts)))]
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, spec.deadline - time.time()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return records


def _run_share_sync(spec: LevelSpec) -> list[dict[str, Any]]:
    if spec.cpus is not None:  # a client process of its own
        os.sched_setaffinity(0, spec.cpus)
    try:
        import uvloop
        factory = uvloop.new_event_loop
    except ImportError:
        factory = None
    with asyncio.Runner(loop_factory=factory) as runner:
        return [asdict(r) for r in runner.run(_run_share(spec))]


def run_level(url: str, payload: dict[str, Any], prompts: list[list[int]], concurrency: int, num_procs: int,
              timeout_s: float, headers: dict[str, str] | None = None, mask_check: str = "parse",
              cpus: list[int] | None = None, endpoint: str = "completions",
              stream: bool = True) -> tuple[list[RequestRecord], float, float]:
    """Send `prompts` with `concurrency` in flight over `num_procs` client processes; returns records, start, end."""
    num_procs = max(1, min(num_procs, concurrency, len(prompts)))
    if num_procs == 1:
        start = time.time()
        spec = LevelSpec(url, payload, prompts, concurrency, start, start + timeout_s, headers or {}, mask_check,
                         cpus, endpoint, stream)
        # NOTE: this process is the client here: pinned for the level only (a server started later inherits it).
        before = os.sched_getaffinity(0)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        try:
            records = asyncio.run(_run_share(spec))
        finally:
            os.sched_setaffinity(0, before)
    else:
        # NOTE: spawned workers import httpx first; start_at gives them a common start once all are ready.
        start = time.time() + 2.0
        specs = [LevelSpec(url, payload, prompts[p::num_procs], len(range(p, concurrency, num_procs)), start,
                           start + timeout_s, headers or {}, mask_check, cpus, endpoint, stream)
                 for p in range(num_procs)]
        with multiprocessing.get_context("spawn").Pool(num_procs) as pool:
            shares = pool.map(_run_share_sync, specs)
        records = [RequestRecord(**d) for share in shares for d in share]
    deadline = start + timeout_s
    # NOTE: a late client process only delays the first request; the level starts when the load does.
    start = min((r.start for r in records if r.start > 0), default=start)
    end = min(max((r.end for r in records if r.end is not None), default=start), deadline)
    return records, start, end


def raise_open_files_limit() -> None:
    """Lift the soft limit on open files to the hard one: a thousand streams need a thousand sockets."""
    try:
        import resource
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
    except (ImportError, ValueError, OSError):
        pass


def resolve_model(base_url: str, headers: dict[str, str]) -> tuple[str, str | None]:
    """The served model name and its root path from GET /v1/models."""
    resp = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30, trust_env=False)
    resp.raise_for_status()
    card = resp.json()["data"][0]
    return card["id"], card.get("root")


def vocab_size_from(root: str | None) -> int | None:
    """vocab_size from a local config.json (the server runs on this machine), else None."""
    if not root or not os.path.isfile(os.path.join(root, "config.json")):
        return None
    with open(os.path.join(root, "config.json")) as f:
        config = json.load(f)
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if vocab else None


def default_num_procs(concurrency: int) -> int:
    return max(1, min((os.cpu_count() or 1) // 2, math.ceil(concurrency / 96)))


def build_payload(args: argparse.Namespace, model: str, max_tokens: int) -> dict[str, Any]:
    """Every request's fields but its prompt (prompt_field), for --endpoint and --no-stream."""
    sampling: dict[str, Any] = {"max_tokens": max_tokens, "ignore_eos": True, "temperature": args.temperature,
                                "top_p": args.top_p}
    if args.top_k is not None:
        sampling["top_k"] = args.top_k
    endpoint = getattr(args, "endpoint", "completions")
    stream = not getattr(args, "no_stream", False)
    if args.logprobs is not None:
        if endpoint == "chat":
            sampling.update(logprobs=True, top_logprobs=args.logprobs)
        else:
            sampling["logprobs"] = args.logprobs
    payload: dict[str, Any] = {"model": model, "stream": stream}
    if endpoint == "generate":
        payload["sampling_params"] = sampling
    else:
        payload.update(sampling)
        if not stream:
            payload["return_token_ids"] = True
    if stream:
        payload["stream_options"] = {"include_usage": True}
    payload.update(json.loads(args.extra_body) if args.extra_body else {})
    return payload


def run_benchmark(args: argparse.Namespace, log: Any = print) -> list[dict[str, Any]]:
    """All levels of one server; `args` as parsed by `make_parser()`. Returns one summary dict per concurrency."""
    base_url = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model, root = resolve_model(base_url, headers)
    vocab = args.vocab_size or vocab_size_from(root)
    if vocab is None:
        raise ValueError("Cannot tell the vocabulary size from /v1/models: pass --vocab-size.")
    rng = np.random.default_rng(args.seed)
    cpus = sorted(parse_cpu_list(args.cpus)) if args.cpus else None
    url = base_url + ENDPOINTS[args.endpoint]
    level_kw = {"endpoint": args.endpoint, "stream": not args.no_stream}
    results: list[dict[str, Any]] = []
    for concurrency in args.concurrency:
        num_prompts = args.num_prompts or max(concurrency, 128)
        num_procs = args.num_client_procs or default_num_procs(concurrency)
        level_timeout = args.level_timeout
        if args.num_warmups != 0:
            num_warm = concurrency if args.num_warmups < 0 else args.num_warmups
            warm = rng.integers(0, vocab, (num_warm, args.input_len)).tolist()
            t0 = time.time()
            records, _, _ = run_level(url, build_payload(args, model, args.warmup_output_len), warm,
                                      min(concurrency, num_warm), num_procs, level_timeout or 1e9, headers,
                                      args.mask_check, cpus, **level_kw)
            bad = [r.error for r in records if r.error is not None]
            log(f"warmup c={concurrency}: {num_warm} requests in {time.time() - t0:.1f}s"
                + (f", {len(bad)} failed: {bad[0]}" if bad else ""))
            if level_timeout is not None:
                level_timeout = max(1.0, level_timeout - (time.time() - t0))
        prompts = rng.integers(0, vocab, (num_prompts, args.input_len)).tolist()
        records, start, end = run_level(url, build_payload(args, model, args.output_len), prompts,
                                        concurrency, num_procs, level_timeout or 1e9, headers, args.mask_check, cpus,
                                        **level_kw)
        summary = summarize(records, start, end, concurrency, args.input_len)
        truncated = summary["truncated"]
        summary["client_procs"] = num_procs
        results.append(summary)
        log(f"c={concurrency}: {summary['output_throughput']:.0f} out tok/s, {summary['completed']}/{num_prompts}"
            f" done in {summary['duration_s']:.1f}s" + (" (cut at --level-timeout)" if truncated else "")
            + (f", {summary['failed']} failed: {summary['errors_sample'][0]}" if summary["failed"] else ""))
    return results


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server, without /v1.")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64], help="Requests kept in flight.")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions",
                        help="completions: /v1/completions; chat: /v1/chat/completions (the server needs a tokenizer, "
                             "see prompt_field); generate: /inference/v1/generate.")
    parser.add_argument("--no-stream", action="store_true",
                        help="One JSON body per request instead of server-sent events (what RL clients read).")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="Requests per concurrency level (default: max(concurrency, 128)).")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="Prompt ids are drawn from [0, vocab); default: the served model's config.json.")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--logprobs", type=int, default=None)
    parser.add_argument("--extra-body", default=None, help="JSON object merged into every request body.")
    parser.add_argument("--num-warmups", type=int, default=-1,
                        help="Warmup requests before each level (-1: as many as the concurrency; 0: none).")
    parser.add_argument("--warmup-output-len", type=int, default=8)
    parser.add_argument("--mask-check", choices=MASK_CHECKS, default="parse",
                        help="How the client checks the masks: parse them into lists (default) or count them from "
                             "their raw JSON (same counts, far less client CPU; see the module docstring).")
    parser.add_argument("--cpus", default=None,
                        help="Run the client processes on these CPUs only (taskset's list form, e.g. 8-15), away "
                             "from the server's.")
    parser.add_argument("--num-client-procs", type=int, default=0,
                        help="Client processes per level (0: one per 128 in flight, at most a quarter of the CPUs).")
    parser.add_argument("--level-timeout", type=float, default=None,
                        help="Seconds per level (warmup included); requests still running then are cancelled and "
                             "their tokens so far counted.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", default=None)
    return parser


def validate(args: argparse.Namespace) -> None:
    if min(args.concurrency) < 1 or args.input_len < 1 or args.output_len < 1:
        raise ValueError("--concurrency, --input-len and --output-len must be >= 1.")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1.")
    if args.extra_body is not None and not isinstance(json.loads(args.extra_body), dict):
        raise ValueError("--extra-body must be a JSON object.")
    if args.cpus is not None and not parse_cpu_list(args.cpus) <= os.sched_getaffinity(0):
        raise ValueError(f"--cpus {args.cpus}: not all of them are CPUs this process may run on.")


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    try:
        validate(args)
    except (ValueError, json.JSONDecodeError) as e:
        parser.error(str(e))
    raise_open_files_limit()
    results = run_benchmark(args, log=lambda msg: print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True))
    print(markdown_table(results), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    if any(r["failed"] or r["masks_ok"] is False for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
