"""The sampling fields a completions and a chat request share: OpenAI's and vLLM's extras, and their conversion to
SamplingParams.

Invariants:
- Every field here reaches SamplingParams (`_sampling_params`), none is dropped; SamplingParams checks the values
  (a VLLMValidationError naming the field, HTTP 400), the JSON schema only documents its bounds (protocol_base.py).
- A field left unset (None) is left out of SamplingParams (`SamplingParams.from_optional`), so SamplingParams'
  default applies; at the server the model's generation_config defaults fill such fields first
  (`OpenAIServing.with_defaults`, serving_engine.py).
- A streamed request gets DELTA outputs, a whole one FINAL_ONLY; a streamed request cannot ask for prompt logprobs.
"""

from __future__ import annotations

from pydantic import Field, StrictBool

from vllm.entrypoints.openai.protocol_base import (INT64_MAX, INT64_MIN, TOKEN_ID_SCHEMA, Float, Int,
                                                   RequestModel, Text, TokenId, bounds)
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams


class SamplingFields(RequestModel):
    """OpenAI's sampling fields and vLLM's extras, shared by completions and chat."""

    temperature: Float | None = Field(None, **bounds(minimum=0, maximum=2))
    top_p: Float | None = Field(None, **bounds(exclusiveMinimum=0, maximum=1))
    n: Int = Field(1, **bounds(minimum=1))
    seed: Int | None = Field(None, **bounds(minimum=INT64_MIN, maximum=INT64_MAX))
    stop: str | list[str] | None = None
    presence_penalty: Float | None = Field(None, **bounds(minimum=-2, maximum=2))
    frequency_penalty: Float | None = Field(None, **bounds(minimum=-2, maximum=2))
    top_k: Int | None = Field(None, **bounds(minimum=-1, maximum=INT64_MAX))
    min_p: Float | None = Field(None, **bounds(minimum=0, maximum=1))
    repetition_penalty: Float | None = Field(None, **bounds(exclusiveMinimum=0, maximum=2))
    ignore_eos: StrictBool = False
    min_tokens: Int = Field(0, **bounds(minimum=0, maximum=INT64_MAX))
    stop_token_ids: list[TokenId] | None = Field(None, **bounds(items=TOKEN_ID_SCHEMA))
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    return_sampling_mask: StrictBool | None = None
    return_token_ids: StrictBool = False
    # vLLM's: the prompt tokens' logprobs (-1: the whole vocabulary), and logprob tokens as "token_id:{id}"
    # (None: the server's --return-tokens-as-token-ids).
    prompt_logprobs: Int | None = Field(None, **bounds(minimum=-1, maximum=INT64_MAX))
    return_tokens_as_token_ids: StrictBool | None = None
    # OpenAI's JSON keys are strings of token ids; SamplingParams converts them, clamps the values to [-100, 100].
    logit_bias: dict[str, Float] | None = None
    bad_words: list[Text] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, **bounds(items=TOKEN_ID_SCHEMA))

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, stream: bool,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        if stream and self.prompt_logprobs is not None and (self.prompt_logprobs > 0 or self.prompt_logprobs == -1):
            raise VLLMValidationError("`prompt_logprobs` are not available when `stream=True`.",
                                      parameter="prompt_logprobs", value=self.prompt_logprobs)
        return SamplingParams.from_optional(
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            return_sampling_mask=self.return_sampling_mask, logprobs=logprobs, max_tokens=max_tokens,
            logit_bias=self.logit_bias, bad_words=self.bad_words, allowed_token_ids=self.allowed_token_ids,
            output_kind=RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY)
