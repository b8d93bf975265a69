"""POST /inference/v1/generate: vLLM's token-ids-in / token-ids-out endpoint for RL clients.

Request `{request_id?, token_ids, sampling_params: {...}, model?, stream?}`; response `{request_id, choices:
[{index, token_ids, logprobs, finish_reason, sampling_mask}], prompt_logprobs}`. Logprobs use the chat format;
`prompt_logprobs` (sampling_params.prompt_logprobs) is vLLM's: None for the first prompt token, then
{str(token id): {logprob, rank, decoded_token}} per prompt token (in the first streamed chunk that has them);
`sampling_mask[i]` is the ascending support of `token_ids[i]` (per chunk when streaming). `sampling_params.n`
gives n choices (index j = sample j); a streamed chunk holds the choices with new tokens in that step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from vllm.entrypoints.openai.protocol_generate import (GenerateRequest, GenerateResponse, GenerateResponseChoice,
                                                       GenerateStreamResponse)
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, SplicedJSONResponse, SSEStream, mask_texts,
                                                    prompt_logprobs_json, sse, weight_spans, with_mask_texts)
from vllm.exceptions import VLLMValidationError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.v1.engine.async_llm import OutputStream
from vllm.v1.engine.input_processor import check_max_tokens


class OpenAIServingGenerate(OpenAIServing):
    def _choices(self, out: RequestOutput, num_logprobs: int) -> list[GenerateResponseChoice]:
        return [self._choice(c, num_logprobs) for c in sorted(out.outputs, key=lambda c: c.index)]

    def _choice(self, c: CompletionOutput, num_logprobs: int, with_mask: bool = True) -> GenerateResponseChoice:
        return GenerateResponseChoice(
            index=c.index, token_ids=list(c.token_ids), finish_reason=c.finish_reason,
            logprobs=self.chat_logprobs(c.token_ids, c.logprobs, num_logprobs) if c.logprobs is not None else None,
            sampling_mask=c.sampling_mask.token_ids if c.sampling_mask is not None and with_mask else None,
            weight_versions=weight_spans(c))

    async def generate(self, request: GenerateRequest) -> GenerateResponse | SplicedJSONResponse | SSEStream:
        self.model_name(request.model)
        params = request.to_sampling_params()
        if not request.token_ids:
            raise VLLMValidationError("token_ids must be a non-empty list of prompt token ids.",
                                      parameter="token_ids")
        check_max_tokens(params.max_tokens, len(request.token_ids), self.max_model_len,
                         "sampling_params.max_tokens")
        prompt: dict[str, Any] = {"prompt_token_ids": list(request.token_ids)}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        queue = await self.engine.add_request(request.request_id, prompt, params)
        gen = self.engine.stream_outputs(request.request_id, queue)
        num_logprobs = params.logprobs or 0
        if request.stream:
            return SSEStream(self._stream(request, gen, num_logprobs), [gen])
        final: RequestOutput | None = None
        async for out in gen:
            final = out
        assert final is not None
        num_out = sum(len(c.token_ids) for c in final.outputs)
        usage = self.usage(len(request.token_ids), num_out, final.num_cached_tokens or 0)
        outputs = sorted(final.outputs, key=lambda c: c.index)
        texts = mask_texts(outputs)
        choices = [self._choice(c, num_logprobs, with_mask=text is None) for c, text in zip(outputs, texts)]
        return with_mask_texts(GenerateResponse(request_id=request.request_id, choices=choices, usage=usage,
                                                prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs)), texts)

    async def _stream(self, request: GenerateRequest, gen: OutputStream,
                      num_logprobs: int) -> AsyncGenerator[bytes, None]:
        async for out in gen:
            yield sse(GenerateStreamResponse(request_id=request.request_id, choices=self._choices(out, num_logprobs),
                                             prompt_logprobs=prompt_logprobs_json(out.prompt_logprobs)))
        yield SSE_DONE
