"""One API server's host work per engine step, without a device or sockets: what `vllm serve` does with one
OUTPUTS message for its share of a step's requests, mask off and on.

What it isolates: the part of a streamed /v1/completions token that an API server process spends in Python,
from the engine core's frames to the SSE bytes: `decode` (msgpack with the zero-copy mask frames, and the
step-level arrays cut per output), `process` (OutputProcessor: tokens, logprobs, masks, one RequestOutput per
request into its collector) and `chunks` (each stream takes its output and builds its SSE chunk: the choice dict,
logprobs, the mask's JSON text spliced in, msgspec encoding; with `--streams` through the server's real async
generators instead: one asyncio task per request iterating `stream_errors(OpenAIServingCompletion._stream(...))`
over `AsyncLLM.stream_outputs`, as the HTTP response does, minus the socket). The frames are the engine core's real ones
(`EngineCoreProc.send_outputs` of a scheduler step, as in host_step.py), for `--clients` API servers of which
this is the first; like in the A/B, requests stream (DELTA), with logprobs=1, and no tokenizer
(`--skip-tokenizer-init`).

    python tools/profiling/frontend_step.py --num-reqs 1024 --clients 4 [--cprofile]

Prints the median ms per step of each part for each arm and the mask arm's extra cost per token. The garbage
collector runs as in an API server (start-up heap frozen, its serving thresholds).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import pstats
import sys
import time
from typing import Any

import numpy as np

from host_step import _runner_output, _vllm_config  # noqa: E402 (tools/profiling/ is the script's folder)
from vllm.v1.serving_gc import freeze_startup_heap
from vllm.entrypoints.openai.protocol_completion import CompletionRequest
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import sse, stream_errors
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.engine.core_proc import EngineCoreProc
from vllm.v1.engine.output_collector import RequestOutputCollector
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.request import Request
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder


class _CaptureProc(EngineCoreProc):
    """EngineCoreProc's output path with the sockets replaced by a list of each client's frames."""

    def __init__(self, num_clients: int) -> None:  # noqa: super().__init__ would open sockets
        self.output_sockets = [None] * num_clients
        self.client_of = {}
        self.aborted_client = {}
        self.encoder = MsgpackEncoder()
        self.frames: list[list[Any]] = [[] for _ in range(num_clients)]

    def send(self, kind: bytes, payload: Any, client: int = 0) -> None:
        # NOTE: copied, as the receiving side's ZMQ frames are (the engine's views are of its own step arrays).
        self.frames[client] = [bytes(f) for f in self.encoder.encode_frames(payload)]


class _Engine:
    """What OpenAIServing reads from its engine, and AsyncLLM's own stream_outputs over its collectors."""

    tokenizer = None
    stream_outputs = AsyncLLM.stream_outputs

    class model_config:  # noqa: N801
        max_model_len = 100_000

    def __init__(self) -> None:
        self.aborted: list[str] = []  # no stream may end before the timed steps are over

    def _abort_now(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def _params(mask: bool) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=100_000, ignore_eos=True,
                          return_sampling_mask=mask or None, output_kind=RequestOutputKind.DELTA)


def engine_frames(num_reqs: int, num_clients: int, mask: bool, mask_size: int) -> tuple[list[Any], list[str]]:
    """The first client's frames of one decode step of `num_reqs` running requests, and that client's ids."""
    config = _vllm_config(num_reqs)
    sched = Scheduler(config, max(num_reqs * 64, 100_000 // 16 + 1))  # room for one max_model_len request
    proc = _CaptureProc(num_clients)
    for i in range(num_reqs):
        req_id = f"cmpl-{i:08x}-0"
        sched.add_request(Request(req_id, list(range(3, 3 + 8)), _params(mask), None))
        proc.client_of[req_id] = i % num_clients
    rng = np.random.default_rng(0)
    out = sched.schedule()  # the prefill step
    sched.update_from_output(out, _runner_output(list(out.num_scheduled_tokens), mask, mask_size, rng,
                                                 proc.client_of))
    out = sched.schedule()
    proc.send_outputs(sched.update_from_output(out, _runner_output(list(out.num_scheduled_tokens), mask, mask_size,
                                                                   rng, proc.client_of)))
    return proc.frames[0], [r for r, c in proc.client_of.items() if c == 0]


def run(num_reqs: int, num_clients: int, mask: bool, steps: int, mask_size: int, profile: bool,
        streams: bool = False, steps_per_chunk: int = 1) -> dict:
    return asyncio.run(_run(num_reqs, num_clients, mask, steps, mask_size, profile, streams, steps_per_chunk))


async def _run(num_reqs: int, num_clients: int, mask: bool, steps: int, mask_size: int, profile: bool,
               streams: bool, steps_per_chunk: int) -> dict:
    frames, req_ids = engine_frames(num_reqs, num_clients, mask, mask_size)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    engine = _Engine()
    serving = OpenAIServingCompletion(engine, ["model"])  # type: ignore[arg-type]
    request = CompletionRequest(model="model", prompt=[3, 4, 5], max_tokens=100_000, temperature=1.0, top_p=0.95,
                                top_k=512, logprobs=1, stream=True, ignore_eos=True)
    proc = OutputProcessor(None, log_stats=False)
    collectors: dict[str, RequestOutputCollector] = {}
    for req_id in req_ids:
        collectors[req_id] = RequestOutputCollector(RequestOutputKind.DELTA)
        proc.add_request(EngineCoreRequest(request_id=req_id, prompt_token_ids=list(range(3, 3 + 8)),
                                           sampling_params=_params(mask), eos_token_id=None), None,
                         collectors[req_id])
    pending = num_bytes = 0
    step_done = asyncio.Event()

    async def consume(req_id: str) -> None:
        """--streams: one request's chunks through the server's generators, as its HTTP response takes them."""
        nonlocal pending, num_bytes
        outputs = engine.stream_outputs(req_id, collectors[req_id])
        async for event in stream_errors(serving._stream(request, "model", req_id, [outputs])):
            if event.startswith(b"data: {") if isinstance(event, bytes) else event.startswith("data: {"):
                num_bytes += len(event)
                pending -= 1
                if not pending:
                    step_done.set()

    def build_chunks(check: bool) -> None:
        """Without --streams: each request's chunk built directly from its collector's output."""
        nonlocal num_bytes
        for req_id in req_ids:
            out = collectors[req_id].get_nowait()
            c = out.outputs[0]
            if mask:
                assert c.sampling_mask is not None and len(c.sampling_mask) == len(c.token_ids) == steps_per_chunk
            choice = serving._choice(request, 0, out, c, 0, raw_mask=True)
            event = sse(serving._chunk("cmpl-x", 0, "model", [choice]))
            num_bytes += len(event)
            if check:  # what a client receives: one token, its logprobs and (mask arm) its mask of ids
                sent = json.loads(event[len("data: "):])["choices"][0]
                assert len(sent["logprobs"]["tokens"]) == steps_per_chunk
                masks = sent["sampling_mask"]
                assert masks is None if not mask else (len(masks) == steps_per_chunk and len(masks[0]) == mask_size
                                                       and masks[0] == sorted(masks[0]))

    tasks = [asyncio.create_task(consume(req_id)) for req_id in req_ids] if streams else []
    await asyncio.sleep(0)
    times: dict[str, list[float]] = {"decode": [], "process": [], "chunks": [], "total": []}
    profiler = cProfile.Profile() if profile else None
    for step in range(steps + 2):
        if profiler and step == 2:
            profiler.enable()
        pending, num_bytes = len(req_ids), 0
        step_done.clear()
        t0 = time.perf_counter()
        dt_decode = 0.0
        for _ in range(steps_per_chunk):  # a lagging server: several engine steps before the streams run
            t = time.perf_counter()
            outputs = decoder.decode(frames[0], frames[1:])
            dt_decode += time.perf_counter() - t
            assert not proc.process_outputs(outputs.outputs).reqs_to_abort
        t1 = t0 + dt_decode
        t2 = time.perf_counter()
        if streams:
            await step_done.wait()
        else:
            build_chunks(check=step == 0)
        t3 = time.perf_counter()
        if step >= 2:  # two warm-up steps; per engine step
            for key, dt in (("decode", t1 - t0), ("process", t2 - t1), ("chunks", t3 - t2), ("total", t3 - t0)):
                times[key].append(dt / steps_per_chunk)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    assert not engine.aborted and not any(t.done() for t in tasks), f"streams ended early: {engine.aborted}"
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    result = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    result["outputs"] = len(req_ids)
    result["kb_per_step"] = (sum(len(f) for f in frames) + num_bytes) / 1e3
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=1024, help="Running requests of the whole engine.")
    parser.add_argument("--clients", type=int, default=4, help="API servers; this one gets every clients-th.")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mask-size", type=int, default=512)
    parser.add_argument("--cprofile", action="store_true", help="Print a cProfile of the mask arm's steps.")
    parser.add_argument("--streams", action="store_true",
                        help="Build the chunks through the server's async streaming generators, one task each.")
    parser.add_argument("--steps-per-chunk", type=int, default=1,
                        help="Engine steps processed before the streams take their outputs (a server that lags "
                             "the engine: each chunk then carries this many tokens). Times are per engine step.")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if min(args.num_reqs, args.clients, args.steps, args.mask_size, args.steps_per_chunk) < 1 or \
            args.clients > args.num_reqs:
        parser.error("--num-reqs, --clients, --steps, --mask-size and --steps-per-chunk must be positive, "
                     "--clients <= --num-reqs.")
    # NOTE: the garbage collector as an API server runs it (start-up heap frozen, serving thresholds): with Python's
    # defaults the young collections land inside the timed steps and inside whatever allocates in the profile.
    freeze_startup_heap()
    results = []
    print(f"{'reqs':>5} {'clients':>7} {'arm':>7} {'decode':>8} {'process':>8} {'chunks':>8} {'total ms':>9} "
          f"{'us/token':>9} {'kB/step':>9}")
    for mask in (False, True):
        r = run(args.num_reqs, args.clients, mask, args.steps, args.mask_size, args.cprofile and mask, args.streams,
                args.steps_per_chunk)
        r.update(num_reqs=args.num_reqs, clients=args.clients, arm="mask" if mask else "no-mask")
        results.append(r)
        print(f"{args.num_reqs:>5} {args.clients:>7} {r['arm']:>7} {r['decode']:8.2f} {r['process']:8.2f} "
              f"{r['chunks']:8.2f} {r['total']:9.2f} {1e3 * r['total'] / r['outputs']:9.1f} {r['kb_per_step']:9.0f}")
    gc.unfreeze()  # NOTE: frozen objects are never freed at exit, which nanobind (triton) reports as leaks
    extra = 1e3 * (results[1]["total"] - results[0]["total"]) / results[0]["outputs"]
    print(f"mask extra per token: {extra:.1f} us")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
