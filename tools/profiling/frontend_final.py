"""One API server's host work for non-streamed responses, without a device or sockets: the engine steps of its
share of the requests (decode the frames, OutputProcessor) and then each request's whole JSON body, for
/v1/completions, /v1/chat/completions and /inference/v1/generate, mask off and on.

What it isolates: what an RL client's non-streamed request costs an API server in Python. The frames are the
engine core's real ones (frontend_step.engine_frames: `EngineCoreProc.send_outputs` of a scheduler step, this
API server's share of `--num-reqs` running requests over `--clients` servers, masks as the device's JSON text);
each request runs through the endpoint's real handler (`create_completion`, `create_chat_completion`,
`generate`) over a stand-in engine whose `add_request` registers it with a real OutputProcessor, and its body is
encoded as the server writes it (`http_responses.respond`). Requests are non-streamed (FINAL_ONLY), logprobs=1,
`return_token_ids`, no tokenizer (`--skip-tokenizer-init`; chat's prompt ids are given).

    python tools/profiling/frontend_final.py --num-reqs 1024 --clients 4 --output-len 256 [--cprofile]

Prints per endpoint and arm, in CPU time of this process (the development machine's CPUs are shared, so wall time
is not comparable between runs; the best of `--repeats`): ms per engine step (decode + process, the median step),
ms for all the bodies of the last step, the body bytes per request, and the CPU ms per request over its whole life
(steps + body); `--cprofile` prints the mask arm's profile of the body building.
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

from frontend_step import engine_frames  # noqa: E402 (tools/profiling/ is the script's folder)
from vllm.entrypoints.openai.http_responses import respond
from vllm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from vllm.entrypoints.openai.protocol_completion import CompletionRequest
from vllm.entrypoints.openai.protocol_generate import GenerateRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_generate import OpenAIServingGenerate
from vllm.v1.serving_gc import freeze_startup_heap
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_collector import RequestOutputCollector
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.serial_utils import MsgpackDecoder

ENDPOINTS = ("completions", "chat", "generate")
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 512, "logprobs": 1, "ignore_eos": True}


class _Engine:
    """What the handlers read from their engine: `add_request` registers the request under the next id of the
    frames with the output processor (the handlers' own ids are random)."""

    tokenizer = None
    stream_outputs = AsyncLLM.stream_outputs

    class model_config:  # noqa: N801
        max_model_len = 100_000

    def __init__(self, processor: OutputProcessor, frame_ids: list[str]) -> None:
        self.processor = processor
        self.frame_ids = list(frame_ids)
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestOutputCollector:
        frame_id = self.frame_ids.pop(0)
        queue = RequestOutputCollector(params.output_kind)
        request = EngineCoreRequest(request_id=frame_id, prompt_token_ids=list(prompt["prompt_token_ids"]),
                                    sampling_params=params, eos_token_id=None)
        list(self.processor.add_request(request, None, queue))
        return queue

    def _abort_now(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


def _handler(endpoint: str, engine: _Engine, max_tokens: int) -> Any:
    """A coroutine factory: one non-streamed request of `endpoint` through its real handler."""
    if endpoint == "completions":
        serving = OpenAIServingCompletion(engine, ["model"])  # type: ignore[arg-type]
        request = CompletionRequest(model="model", prompt=[3, 4, 5], max_tokens=max_tokens, return_token_ids=True,
                                    **SAMPLING)
        return lambda: serving.create_completion(request)
    if endpoint == "chat":
        serving = OpenAIServingChat(engine, ["model"])  # type: ignore[arg-type]

        async def prompt_ids(request: Any) -> list[int]:  # no tokenizer: the rendered prompt's ids
            return [3, 4, 5]

        serving._prompt_token_ids = prompt_ids  # type: ignore[method-assign]
        request = ChatCompletionRequest(model="model", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=max_tokens, return_token_ids=True, top_logprobs=1,
                                        **{**SAMPLING, "logprobs": True})
        return lambda: serving.create_chat_completion(request)
    serving = OpenAIServingGenerate(engine, ["model"])  # type: ignore[arg-type]
    request = GenerateRequest(token_ids=[3, 4, 5], sampling_params={**SAMPLING, "max_tokens": max_tokens})
    return lambda: serving.generate(request)


def run(endpoint: str, num_reqs: int, num_clients: int, mask: bool, output_len: int, mask_size: int,
        profile: bool) -> dict:
    return asyncio.run(_run(endpoint, num_reqs, num_clients, mask, output_len, mask_size, profile))


async def _run(endpoint: str, num_reqs: int, num_clients: int, mask: bool, output_len: int, mask_size: int,
               profile: bool) -> dict:
    frames, frame_ids = engine_frames(num_reqs, num_clients, mask, mask_size)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    processor = OutputProcessor(None, log_stats=False)
    engine = _Engine(processor, frame_ids)
    make = _handler(endpoint, engine, output_len)
    responses: list[Any] = []

    async def one() -> None:
        responses.append(respond(await make()))

    tasks = [asyncio.create_task(one()) for _ in frame_ids]
    while engine.frame_ids:  # every handler has added its request
        await asyncio.sleep(0)
    step_times = []
    for step in range(output_len):
        t0 = time.process_time()
        outputs = decoder.decode(frames[0], frames[1:])
        if step == output_len - 1:
            for o in outputs.outputs:
                o.finish_reason = FinishReason.LENGTH
        processor.process_outputs(outputs.outputs)
        step_times.append(time.process_time() - t0)
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    t0 = time.process_time()
    await asyncio.gather(*tasks)
    body_s = time.process_time() - t0
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
    assert not engine.aborted and len(responses) == len(frame_ids)
    # NOTE: a spliced response is sent as its parts (not joined): its size is theirs.
    sizes = [sum(map(len, r.parts)) if hasattr(r, "parts") else len(r.body) for r in responses]
    sent = json.loads(responses[0].body)["choices"][0]
    assert len(sent["token_ids"]) == output_len
    assert (sent["sampling_mask"] is None) != mask and (not mask or len(sent["sampling_mask"]) == output_len)
    n = len(frame_ids)
    return {"step_ms": 1e3 * float(np.median(step_times)), "bodies_ms": 1e3 * body_s, "requests": n,
            "kb_per_body": sum(sizes) / n / 1e3,
            "ms_per_request": 1e3 * (sum(step_times) + body_s) / n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=1024, help="Running requests of the whole engine.")
    parser.add_argument("--clients", type=int, default=4, help="API servers; this one gets every clients-th.")
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--mask-size", type=int, default=506)
    parser.add_argument("--endpoints", nargs="+", choices=ENDPOINTS, default=list(ENDPOINTS))
    parser.add_argument("--repeats", type=int, default=3, help="Runs per (endpoint, arm); each figure is the best.")
    parser.add_argument("--cprofile", action="store_true", help="Print a cProfile of the mask arm's bodies.")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    freeze_startup_heap()
    results = []
    print(f"{'endpoint':>11} {'arm':>7} {'step ms':>8} {'bodies ms':>10} {'kB/body':>8} {'ms/request':>11}  (CPU)")
    for endpoint in args.endpoints:
        for mask in (False, True):
            runs = [run(endpoint, args.num_reqs, args.clients, mask, args.output_len, args.mask_size,
                        args.cprofile and mask and i == 0) for i in range(args.repeats)]
            r = {k: min(x[k] for x in runs) for k in runs[0]}
            r.update(endpoint=endpoint, arm="mask" if mask else "no-mask")
            results.append(r)
            print(f"{endpoint:>11} {r['arm']:>7} {r['step_ms']:8.2f} {r['bodies_ms']:10.1f} {r['kb_per_body']:8.1f} "
                  f"{r['ms_per_request']:11.3f}", flush=True)
            gc.collect()
    gc.unfreeze()
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
