"""Non-streamed responses with sampling masks (/v1/completions, /v1/chat/completions, /inference/v1/generate): the
body built from the engine's mask text (spliced in as buffers, SplicedJSONResponse) is the same JSON as the body of
the list-based serializer (the masks as Python lists through pydantic, what a mask without text takes), and byte
for byte what the text path wrote before (the whole body encoded by msgspec with each choice's mask text as
msgspec.Raw); its masks are the ones the engine sent, cut with their tokens.

The handlers run for real over a stand-in engine whose `add_request` registers each request with a real
OutputProcessor, fed with hand-built engine steps: n = 2, logprobs, a stop string that cuts a multi-token step,
choices that finish at different steps, multi-token steps (masks with offsets), several prompts (completions).
"""

from __future__ import annotations

import asyncio
import json
import types
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pytest

from vllm.config.model import default_model_path
from vllm.entrypoints.openai import protocol_base
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_engine import SplicedJSONResponse
from vllm.entrypoints.openai.serving_generate import OpenAIServingGenerate
from vllm.entrypoints.openai.api_server import _respond
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_collector import RequestOutputCollector
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists, SamplingMaskText

TEXT = "The quick brown fox jumps over the lazy dog again and again, and the fox sleeps."
OTHER_TEXT = "A lazy dog sleeps under the old tree all day, and the cat watches it from the wall."
STOP = "fox"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return get_tokenizer(default_model_path())


@dataclass
class Position:
    token_id: int
    mask: list[int]
    logprob_ids: list[int]  # the sampled token, then the top 1
    logprobs: list[float]
    rank: int


def make_plan(tok: Tokenizer, num_choices: int, seed: int) -> list[tuple[list[Position], list[int]]]:
    """Per engine request (in the order they are added): its positions and its step sizes. Choice c generates a
    rotation of TEXT's tokens (so it meets the stop string, at a place of its own), the last one OTHER_TEXT's (no
    stop string), each of a length of its own (so they finish at different steps), in steps of 1-3 tokens."""
    rng = np.random.default_rng(seed)
    ids = tok.encode(TEXT, add_special_tokens=False)
    other = tok.encode(OTHER_TEXT, add_special_tokens=False)
    plan = []
    for c in range(num_choices):
        length = 12 + 3 * c
        token_ids = ((ids[3 * c:] + ids) if c < num_choices - 1 else other)[:length]
        positions = []
        for t in token_ids:
            mask = sorted({t, *rng.choice(tok.vocab_size, int(rng.integers(0, 40))).tolist()})
            top = int(rng.integers(0, tok.vocab_size))
            values = sorted(rng.uniform(-12, -0.01, 2).astype(np.float32).tolist(), reverse=True)
            positions.append(Position(t, mask, [t, top], [values[1], values[0]], int(rng.integers(1, 50))))
        sizes: list[int] = []
        while sum(sizes) < length:
            sizes.append(min(int(rng.integers(1, 4)), length - sum(sizes)))
        plan.append((positions, sizes))
    return plan


def step_output(engine_id: str, chunk: list[Position], form: str, last: bool) -> EngineCoreOutput:
    """One engine step of a request: its tokens, logprobs, and masks as ids ("ids") or as JSON text ("text")."""
    logprobs = LogprobsLists(np.array([p.logprob_ids for p in chunk], dtype=np.int32),
                             np.array([p.logprobs for p in chunk], dtype=np.float32),
                             np.array([p.rank for p in chunk], dtype=np.int32))
    out = EngineCoreOutput(engine_id, [p.token_id for p in chunk], logprobs,
                           finish_reason=FinishReason.LENGTH if last else None)
    if form == "ids":
        flat = np.array([i for p in chunk for i in p.mask], dtype=np.int32)
        offsets = np.cumsum([0] + [len(p.mask) for p in chunk]) if len(chunk) > 1 else None
        out.new_sampling_mask = SamplingMaskLists(flat, offsets)
    else:
        rows = [json.dumps(p.mask, separators=(",", ":")).encode() for p in chunk]
        offsets = np.cumsum([0] + [len(r) for r in rows]) if len(chunk) > 1 else None
        out.new_sampling_mask_text = SamplingMaskText(np.frombuffer(b"".join(rows), dtype=np.uint8), offsets)
    return out


class _Engine:
    """What the handlers read from their engine; `add_request` registers the request (or its n children) with the
    output processor and notes the engine-side ids in order."""

    stream_outputs = AsyncLLM.stream_outputs

    class model_config:  # noqa: N801
        max_model_len = 4096

    def __init__(self, processor: OutputProcessor, tok: Tokenizer) -> None:
        self.processor = processor
        self.tokenizer = tok
        self.engine_ids: list[str] = []
        self.aborted: list[str] = []

    async def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> RequestOutputCollector:
        queue = RequestOutputCollector(params.output_kind)
        request = EngineCoreRequest(request_id, list(prompt["prompt_token_ids"]), params, None)
        self.engine_ids += [r.request_id for r in self.processor.add_request(request, prompt.get("prompt"), queue)]
        return queue

    def _abort_now(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids


SAMPLING = {"temperature": 1.0, "top_k": 50, "stop": [STOP], "max_tokens": 64}


def _handler(endpoint: str, engine: _Engine) -> tuple[Any, int]:
    """The endpoint's handler call, and the engine requests it adds."""
    if endpoint == "completions":
        serving = OpenAIServingCompletion(engine, ["m"])  # type: ignore[arg-type]
        request = CompletionRequest(model="m", prompt=[[5, 6, 7], [8, 9]], n=2, logprobs=1, return_token_ids=True,
                                    request_id="fixed", **SAMPLING)
        return serving.create_completion(request), 4
    if endpoint == "chat":
        serving = OpenAIServingChat(engine, ["m"])  # type: ignore[arg-type]
        request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Tell me a story."}], n=2,
                                        logprobs=True, top_logprobs=1, return_token_ids=True, request_id="fixed",
                                        **SAMPLING)
        return serving.create_chat_completion(request), 2
    serving = OpenAIServingGenerate(engine, ["m"])  # type: ignore[arg-type]
    request = GenerateRequest(request_id="fixed", token_ids=[5, 6, 7],
                              sampling_params={**SAMPLING, "n": 2, "logprobs": 1})
    return serving.generate(request), 2


async def _respond_to(endpoint: str, tok: Tokenizer, form: str, seed: int) -> tuple[Any, list]:
    processor = OutputProcessor(tok, log_stats=False)
    engine = _Engine(processor, tok)
    call, num_requests = _handler(endpoint, engine)
    task = asyncio.ensure_future(call)
    while len(engine.engine_ids) < num_requests:
        await asyncio.sleep(0)
    plan = make_plan(tok, num_requests, seed)
    cursor = [(0, 0)] * num_requests  # (next position, next step) per engine request
    while any(e in processor.request_states for e in engine.engine_ids):
        outputs = []
        for k, engine_id in enumerate(engine.engine_ids):
            positions, sizes = plan[k]
            pos, step = cursor[k]
            if engine_id not in processor.request_states or step == len(sizes):
                continue
            chunk = positions[pos:pos + sizes[step]]
            cursor[k] = (pos + len(chunk), step + 1)
            outputs.append(step_output(engine_id, chunk, form, step + 1 == len(sizes)))
        processor.process_outputs(outputs)
        await asyncio.sleep(0)
    response = _respond(await task)
    assert not engine.aborted
    return response, plan


def _old_text_body(reference: bytes) -> bytes:
    """What the text path wrote before: the response's fields encoded by msgspec with each choice's mask as its
    JSON text (msgspec.Raw), here from the list-based body's values."""
    body = json.loads(reference)
    for choice in body["choices"]:
        choice["sampling_mask"] = msgspec.Raw(json.dumps(choice["sampling_mask"], separators=(",", ":")).encode())
    return msgspec.json.encode(body)


@pytest.mark.parametrize("endpoint", ["completions", "chat", "generate"])
@pytest.mark.parametrize("seed", [0, 1])
def test_spliced_mask_text_body_equals_the_list_body(tok: Tokenizer, endpoint: str, seed: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protocol_base, "time", types.SimpleNamespace(time=lambda: 1_700_000_000.0))
    spliced, plan = asyncio.run(_respond_to(endpoint, tok, "text", seed))
    reference, _ = asyncio.run(_respond_to(endpoint, tok, "ids", seed))
    assert isinstance(spliced, SplicedJSONResponse) and not isinstance(reference, SplicedJSONResponse)
    assert int(dict(spliced.raw_headers)[b"content-length"]) == len(spliced.body)
    body = json.loads(spliced.body)
    assert body == json.loads(reference.body)
    assert spliced.body == _old_text_body(reference.body)
    # The masks are the engine's, one per returned token, cut with the tokens by the stop string.
    choices = body["choices"]
    assert len(choices) == len(plan)
    cut = full = 0
    for k, choice in enumerate(choices):
        positions = plan[k][0]
        num = len(choice["token_ids"])
        assert choice["token_ids"] == [p.token_id for p in positions[:num]]
        assert choice["sampling_mask"] == [p.mask for p in positions[:num]]
        if choice["finish_reason"] == "stop":
            assert choice.get("stop_reason", STOP) == STOP and num <= len(positions)  # generate: no stop_reason
            cut += num < len(positions)
        else:
            assert choice["finish_reason"] == "length" and num == len(positions)
            full += 1
    assert cut and full  # a choice cut by the stop string before its end, and one that ran to its length


def test_spliced_body_parts_are_sent_in_order_with_their_length() -> None:
    """The response sends its parts as ASGI body messages in order, the last one ending the body, under a
    Content-Length of their total."""
    response = SplicedJSONResponse([b'{"a":', bytearray(b"[[1,2],"), bytearray(b"[3]]"), b"}"])
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(response({"type": "http"}, None, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-length"] == b"17"
    assert b"".join(m["body"] for m in sent[1:]) == b'{"a":[[1,2],[3]]}'  # 17 bytes
    assert [m["more_body"] for m in sent[1:]] == [True, True, True, False]
