"""The building blocks of every OpenAI protocol model (protocol.py): strict field types, the JSON-schema helpers,
the base models, and the small models several endpoints share (errors, usage, model cards, stream options, weight
version spans).

Invariants:
- Types are strict where lax parsing would change a request's meaning: booleans take only true/false (`StrictBool`
  fields: "stream": "yes" or 1 is a 400), token ids only JSON integers (`TokenId`: [true, false] is a 400, not
  [1, 0]), and `Int` / `Float` fields refuse booleans. Valid input parses as pydantic's lax mode would.
- `Text` refuses strings the tokenizer or the UTF-8 wire would choke on (a lone surrogate), so no such string gets
  past validation to fail after a request was added.
- `bounds` and `requires` only add JSON-schema keywords (openapi.py documents them): they never change what a model
  accepts nor its messages; the checks stay in SamplingParams and the serving code.
- A request model (`RequestModel`) refuses by name the vLLM fields this engine does not implement, unless they ask
  for nothing, and logs the fields no vLLM request has (request_fields.py); it ignores extra fields otherwise.
- A response's `created` is the Unix second `created_timestamp()` reads when the model is built.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictInt,
                      ValidatorFunctionWrapHandler, model_validator)

from vllm.entrypoints.openai.request_fields import check_request_fields
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import check_unicode


def _no_bool(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("must be a number, not a boolean")
    return value


def _valid_unicode(value: str) -> str:
    try:
        check_unicode(value, "the string")
    except VLLMValidationError as e:
        raise ValueError(e.args[0]) from None
    return value


# An integer or float field that refuses booleans (pydantic's lax mode reads true as 1).
Int = Annotated[int, BeforeValidator(_no_bool)]
Float = Annotated[float, BeforeValidator(_no_bool)]
# A token id: a JSON integer only.
TokenId = StrictInt
# A string the tokenizer and the UTF-8 wire can take (no lone surrogates).
Text = Annotated[str, AfterValidator(_valid_unicode)]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": INT64_MAX}


def bounds(**schema: Any) -> Any:
    """A field whose JSON schema carries these keywords (the bounds SamplingParams enforces); validation is
    unchanged (module docstring)."""
    return {"json_schema_extra": schema}


def requires(*names: str) -> Any:
    """A model-level json_schema_extra marking fields required that have a default only so that the server can
    refuse them missing with its own message."""
    def extra(schema: dict[str, Any]) -> None:
        schema["required"] = sorted(set(schema.get("required", [])) | set(names))
    return extra


def created_timestamp() -> int:
    """A response's `created`: the current Unix time in whole seconds."""
    return int(time.time())


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class RequestModel(OpenAIBaseModel):
    """A request body: vLLM fields not implemented here are refused, unknown ones logged (request_fields.py)."""

    @model_validator(mode="wrap")
    @classmethod
    def _check_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        check_request_fields(cls.model_fields, data, cls.__name__)
        return handler(data)


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


class ModelCard(OpenAIBaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=created_timestamp)
    owned_by: str = "vllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: str = "list"
    data: list[ModelCard] = Field(default_factory=list)


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With --enable-prompt-tokens-details (vLLM's flag): the prompt tokens found in the prefix cache.
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False


class WeightVersionSpan(OpenAIBaseModel):
    """Tokens [start, end) of a choice (counted from its first token, also in a streamed chunk) were computed by
    the weights named `weight_version` (the name given to finish_weight_update / update_weight_version)."""
    weight_version: str | None = None
    start: int
    end: int
