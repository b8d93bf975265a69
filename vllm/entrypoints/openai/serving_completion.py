"""POST /v1/completions: one engine request per prompt, JSON or SSE, with logprobs and sampling masks.

Every prompt is validated and added before anything streams (a bad one is a 400 and aborts the others): `n` times
the number of prompts is at most VLLM_MAX_N_SEQUENCES, and text prompts are tokenized here (long ones off the event
loop, after a check of their characters against the context), so that `max_tokens` is checked against the context
each prompt leaves (vLLM's 400) before any request is added; each
streamed chunk carries the token ids' masks of that chunk, so the chunks of a choice concatenate to one mask per
generated token. With `n` samples per prompt, prompt i's sample j is choice `i * n + j` (vLLM's numbering), and
usage counts each prompt once and every choice's completion tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from vllm.entrypoints.openai.protocol_base import UsageInfo
from vllm.entrypoints.openai.protocol_completion import CompletionRequest, CompletionResponse
from vllm import envs
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, SplicedJSONResponse, SSEStream,
                                                    prompt_logprobs_json, sse, weight_spans, with_mask_texts)
from vllm.exceptions import VLLMValidationError
from vllm.inputs import PromptType
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import check_unicode
from vllm.utils import random_uuid
from vllm.v1.engine.async_llm import OutputStream
from vllm.v1.engine.input_processor import check_max_tokens


def parse_prompts(prompt: Any) -> list[PromptType]:
    if prompt is None or (isinstance(prompt, (str, list)) and len(prompt) == 0):
        raise VLLMValidationError("prompt is required: send a string, a list of strings, or token ids.",
                                  parameter="prompt")
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    prompts: list[PromptType] = []
    for p in prompt:
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            prompts.append({"prompt_token_ids": list(p)})
        else:
            raise VLLMValidationError("Each prompt must be a non-empty string or a non-empty list of token ids.",
                                      parameter="prompt")
    return prompts


async def merge_streams(streams: list[OutputStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several output streams, tagging each output with its stream's index. However it ends (done,
    closed, cancelled, an error), every stream is closed: those not finished are aborted."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].close()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: OutputStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        # NOTE: close() works while a pump still waits inside its stream (a cancelled task may not have run yet).
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.close()


class OpenAIServingCompletion(OpenAIServing):
    async def _start(self, request: CompletionRequest) -> tuple[str, list[str], list[OutputStream]]:
        params = self.with_defaults(request).to_sampling_params()
        prompts = parse_prompts(request.prompt)
        max_n = envs.VLLM_MAX_N_SEQUENCES
        if len(prompts) * params.n > max_n:
            raise VLLMValidationError(f"n x the number of prompts must be at most {max_n} (VLLM_MAX_N_SEQUENCES), "
                                      f"got {params.n} x {len(prompts)}.", parameter="n", value=params.n)
        prompts = [await self._tokenized(p, params.max_tokens) for p in prompts]
        if request.cache_salt is not None:
            prompts = [{**p, "cache_salt": request.cache_salt} if isinstance(p, dict)
                       else {"prompt": p, "cache_salt": request.cache_salt} for p in prompts]
        base_id = f"cmpl-{random_uuid()}"
        request_ids: list[str] = []
        gens: list[OutputStream] = []
        try:
            for i, prompt in enumerate(prompts):
                req_id = f"{base_id}-{i}"
                queue = await self.engine.add_request(req_id, prompt, params.clone())
                request_ids.append(req_id)
                gens.append(self.engine.stream_outputs(req_id, queue))
        except BaseException:
            await self.engine.abort(request_ids)
            raise
        return base_id, request_ids, gens

    async def _tokenized(self, prompt: PromptType, max_tokens: int | None) -> PromptType:
        """A text prompt as token ids with its text (as the input processor would tokenize it), checked against
        `max_tokens`; token-id prompts are checked as they are. Without a tokenizer the prompt is passed on (the
        input processor refuses text then). A text too long in characters is refused untokenized, a long one is
        tokenized off the event loop (OpenAIServing.encode)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return prompt
            check_unicode(prompt, "prompt")
            prompt = {"prompt_token_ids": await self.encode(prompt, True, "prompt"), "prompt": prompt}
        assert isinstance(prompt, dict)
        check_max_tokens(max_tokens, len(prompt["prompt_token_ids"]), self.max_model_len)
        return prompt

    def _prompt_text(self, out: RequestOutput) -> str:
        """The prompt's text for echo: as sent, or decoded from its token ids (vLLM)."""
        if out.prompt is not None:
            return out.prompt
        if self.tokenizer is None or not out.prompt_token_ids:
            return ""
        return self.tokenizer.decode(list(out.prompt_token_ids), skip_special_tokens=False)

    def _choice(self, request: CompletionRequest, index: int, out: RequestOutput, c: CompletionOutput,
                text_offset: int, echo: bool = False, first: bool = True, raw_mask: bool = False,
                skip_mask: bool = False) -> dict[str, Any]:
        """One choice with CompletionResponseChoice's fields, as a plain dict (streamed chunks skip pydantic).

        echo: this (first) chunk of the choice starts with the prompt: its text, and with logprobs its tokens'
        logprobs (None for the first one) before the generated ones; with echo and max_tokens 0 the prompt alone
        (the generated token's text and logprobs dropped, as vLLM).
        raw_mask: the mask goes in as the engine's JSON text (msgspec.Raw) when it has it: for bodies encoded by
        msgspec, i.e. streamed chunks. skip_mask: no mask (a whole response's, which with_mask_texts splices in)."""
        mask: Any = None
        if c.sampling_mask is not None and not skip_mask:
            text = c.sampling_mask.json_text() if raw_mask else None
            mask = msgspec.Raw(text) if text is not None else c.sampling_mask.token_ids
        text, lp_ids, lps = c.text, c.token_ids, c.logprobs
        if request.echo_without_generation:
            text, lp_ids, lps = "", [], []
        if echo:
            prompt_ids = list(out.prompt_token_ids or [])
            prompt_lps = list(out.prompt_logprobs) if out.prompt_logprobs is not None else [None] * len(prompt_ids)
            text = self._prompt_text(out) + text
            lp_ids = prompt_ids + list(lp_ids)
            lps = prompt_lps + list(lps or [])
        choice = {
            "index": index, "text": text,
            "logprobs": (self.completion_logprobs(lp_ids, lps, request.logprobs or 0, text_offset,
                                                  self.tokens_as_ids(request.return_tokens_as_token_ids))
                         if request.logprobs is not None else None),
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
            "token_ids": list(c.token_ids) if request.return_token_ids else None,
            "prompt_token_ids": list(out.prompt_token_ids or []) if request.return_token_ids and first else None,
            "sampling_mask": mask,
        }
        if c.weight_versions:  # NOTE: the key only once the engine's weights were named
            choice["weight_versions"] = weight_spans(c)
        if first and out.prompt_logprobs is not None:  # NOTE: the key only when asked (or implied by echo)
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        return choice

    @staticmethod
    def _chunk(base_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: UsageInfo | None = None) -> dict[str, Any]:
        """A CompletionStreamResponse as a plain dict (the same fields and order)."""
        return {"id": base_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices, "usage": usage.model_dump() if usage is not None else None}

    async def create_completion(self, request: CompletionRequest
                                ) -> CompletionResponse | SplicedJSONResponse | SSEStream:
        model = self.model_name(request.model)
        base_id, request_ids, gens = await self._start(request)
        if request.request_id:  # vLLM's: the response id names the client's request_id (engine ids stay unique)
            base_id = f"cmpl-{request.request_id}"
        if request.stream:
            return SSEStream(self._stream(request, model, base_id, gens), gens)
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge_streams(gens):
            finals[i] = out
        choices = []
        texts: list[list[Any] | None] = []
        prompt_tokens = completion_tokens = cached_tokens = 0
        for i in range(len(gens)):
            out = finals[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                # NOTE: a mask as the engine's JSON text skips pydantic (with_mask_texts splices it into the body).
                text = c.sampling_mask.json_parts() if c.sampling_mask is not None else None
                texts.append(text)
                choices.append(self._choice(request, i * request.n + c.index, out, c, 0, request.echo,
                                            skip_mask=text is not None))
                completion_tokens += len(c.token_ids)
            prompt_tokens += len(out.prompt_token_ids or [])
            cached_tokens += out.num_cached_tokens or 0
        usage = self.usage(prompt_tokens, completion_tokens, cached_tokens)
        return with_mask_texts(CompletionResponse(id=base_id, model=model, choices=choices, usage=usage), texts)

    async def _stream(self, request: CompletionRequest, model: str, base_id: str,
                      gens: list[OutputStream]) -> AsyncGenerator[bytes, None]:
        num_choices = len(gens) * request.n
        created = int(time.time())
        offsets = [0] * num_choices
        # NOTE: plain ints, not a UsageInfo (a pydantic model's __setattr__ on every chunk).
        prompt_tokens = completion_tokens = 0
        cached_tokens = [0] * len(gens)
        prompt_counted = [False] * len(gens)
        prompt_logprobs: list[Any] = [None] * len(gens)
        started = [False] * num_choices
        # NOTE: one stream (a single prompt) is read directly: merge_streams would add an async generator step per
        # chunk for nothing; its close on the way out is done here.
        single = len(gens) == 1
        outputs: Any = gens[0] if single else merge_streams(gens)
        n, echo = request.n, request.echo
        try:
            async for item in outputs:
                i, out = (0, item) if single else item
                if not prompt_counted[i]:
                    prompt_counted[i] = True
                    prompt_tokens += len(out.prompt_token_ids or [])
                # NOTE: a DELTA output carries the prompt logprobs once; with n > 1 a sample's first chunk may
                # come later, and echo needs them there.
                if out.prompt_logprobs is not None:
                    prompt_logprobs[i] = out.prompt_logprobs
                elif echo and prompt_logprobs[i] is not None:
                    out.prompt_logprobs = prompt_logprobs[i]
                if out.num_cached_tokens:
                    cached_tokens[i] = out.num_cached_tokens
                for c in out.outputs:
                    index = i * n + c.index
                    first = not started[index]
                    started[index] = True
                    completion_tokens += len(c.token_ids)
                    if request.echo_without_generation and not first:
                        continue  # the prompt alone was the answer
                    # NOTE: no local keeps the choice while the stream waits for its next output: its mask text
                    # (a ~3.4 KB copy per token) would stay alive in every waiting stream, and each new chunk be
                    # built in memory that is no longer in cache.
                    choice = self._choice(request, index, out, c, offsets[index], first and echo, first,
                                          raw_mask=True)
                    offsets[index] += len(choice["text"])
                    yield sse(self._chunk(base_id, created, model, [choice]))
                    del choice
        finally:
            if single:
                gens[0].close()
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = self.usage(prompt_tokens, completion_tokens, sum(cached_tokens))
            yield sse(self._chunk(base_id, created, model, [], usage))
        yield SSE_DONE
