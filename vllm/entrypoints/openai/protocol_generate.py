"""The /inference/v1/generate models (vLLM's token-ids-in / token-ids-out endpoint for RL clients): the request,
its choices, the whole response and the streamed chunk.

Invariants:
- `sampling_params` is SamplingParams' own fields by name: an unknown field, a field a request cannot set
  (output_kind, output_text_buffer_length, _all_stop_token_ids) or a value of the wrong type (a boolean is not an
  integer) is a VLLMValidationError naming `sampling_params.<field>`; SamplingParams' checks name it the same way.
- `token_ids` is required, each a JSON integer (an empty list is refused by serving_generate.py, the schema
  documents it); `request_id` is never empty (a random one when unset).
- A streamed request gets DELTA outputs, a whole one FINAL_ONLY, whatever sampling_params says.
"""

from __future__ import annotations

from typing import Any

import msgspec
from pydantic import Field, StrictBool

from vllm.entrypoints.openai.protocol_base import (TOKEN_ID_SCHEMA, OpenAIBaseModel, RequestModel, StreamOptions,
                                                   Text, TokenId, UsageInfo, WeightVersionSpan, bounds)
from vllm.entrypoints.openai.protocol_chat import ChatCompletionLogProbs
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.utils import random_uuid


class GenerateRequest(RequestModel):
    """vLLM's token-ids-in / token-ids-out request (`/inference/v1/generate`)."""

    request_id: Text = Field(default_factory=random_uuid, min_length=1)
    token_ids: list[TokenId] = Field(**bounds(minItems=1, items=TOKEN_ID_SCHEMA))
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: Text | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # Prefix caching: only requests with the same salt share cached KV blocks (a non-empty string).
    cache_salt: Text | None = None

    def to_sampling_params(self) -> SamplingParams:
        fields = dict(self.sampling_params)
        for key in ("output_kind", "output_text_buffer_length", "_all_stop_token_ids"):
            if key in fields:
                raise VLLMValidationError(f"sampling_params.{key} cannot be set by a request.",
                                          parameter=f"sampling_params.{key}")
        fields["output_kind"] = RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY
        known = set(SamplingParams.__struct_fields__)
        unknown = sorted(set(fields) - known)
        if unknown:
            raise VLLMValidationError(f"Unknown sampling_params field(s): {', '.join(map(repr, unknown))}.",
                                      parameter=f"sampling_params.{unknown[0]}")
        try:
            # NOTE: msgspec.convert checks the field types (a Struct's __init__ does not; a bool is not an int
            # there) and runs validation.
            return msgspec.convert({k: v for k, v in fields.items() if v is not None}, SamplingParams)
        except msgspec.ValidationError as e:
            cause = e.__cause__
            if isinstance(cause, VLLMValidationError):  # SamplingParams' own check, raised in __post_init__
                raise VLLMValidationError(cause.args[0], parameter=f"sampling_params.{cause.parameter}"
                                          if cause.parameter else "sampling_params", value=cause.value) from e
            # A type error: msgspec names the field as a path, "Expected `int`, got `bool` - at `$.top_k[1]`".
            path = str(e).rpartition("`$.")[2].rstrip("`").split("[")[0] if "`$." in str(e) else ""
            raise VLLMValidationError(f"Invalid sampling_params: {e}",
                                      parameter=f"sampling_params.{path}" if path else "sampling_params") from e


class GenerateResponseChoice(OpenAIBaseModel):
    index: int
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None
    sampling_mask: list[list[int]] | None = None
    # Only once the engine's weights were named (RL weight updates, docs/rl.md): None until then.
    weight_versions: list[WeightVersionSpan] | None = None


class GenerateResponse(OpenAIBaseModel):
    request_id: str
    choices: list[GenerateResponseChoice]
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    usage: UsageInfo | None = None


class GenerateStreamResponse(GenerateResponse):
    pass
