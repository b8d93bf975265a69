"""vLLM request fields this server does not implement (refused with a 400 naming them) and the warning for fields
no vLLM request model has (ignored, as vLLM does).

Every field of vLLM's CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest and
DetokenizeRequest is either a field of the request model here (implemented), or listed in `REFUSED`: sent with a
value that asks for nothing (None, its default, an empty list or dict) it is accepted, sent with any other value
it is a 400 whose `param` is the field's name. A field neither here nor in the model (a misspelling, a newer
OpenAI field) is ignored and logged with vLLM's warning, "The following fields were present in the request but
ignored: {...}". The table of docs/serving.md lists them all.

`check_request_fields` runs before pydantic validates a request (RequestModel's wrap validator in protocol.py),
so a refused field is reported even when others are also wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from vllm.exceptions import VLLMValidationError

logger = logging.getLogger("vllm.entrypoints.openai.protocol")


def _neutral(*values: Any) -> Callable[[Any], bool]:
    """A value that asks for nothing: None, an empty list / dict / string, or one of `values`."""
    def check(value: Any) -> bool:
        if value is None or (isinstance(value, (list, dict, str)) and not value):
            return True
        return any(value == v and type(value) is type(v) or (isinstance(v, float) and _is_number(value)
                                                               and value == v) for v in values)
    return check


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _text_format(value: Any) -> bool:
    return value is None or value == {"type": "text"}


_STRUCTURED = ("structured outputs (response_format, guided_*, structured_outputs) are not implemented: the "
               "sampling mask would have to be the support after the grammar")
_NOT_IMPLEMENTED = "is not implemented by this engine"

# field -> (value that asks for nothing, why it is refused otherwise)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (_text_format, _STRUCTURED + "; send no response_format or {\"type\": \"text\"}"),
    "structured_outputs": (_neutral(), _STRUCTURED),
    "guided_json": (_neutral(), _STRUCTURED),
    "guided_regex": (_neutral(), _STRUCTURED),
    "guided_choice": (_neutral(), _STRUCTURED),
    "guided_grammar": (_neutral(), _STRUCTURED),
    "structural_tag": (_neutral(), _STRUCTURED),
    "guided_decoding_backend": (_neutral(), _STRUCTURED),
    "guided_whitespace_pattern": (_neutral(), _STRUCTURED),
    "use_beam_search": (_neutral(False), "beam search " + _NOT_IMPLEMENTED),
    "length_penalty": (_neutral(1.0), "length_penalty (beam search) " + _NOT_IMPLEMENTED),
    "best_of": (_neutral(1), "best_of is not supported (as in vLLM v1): set n and rank the samples yourself"),
    "suffix": (_neutral(), "suffix (fill-in-the-middle) " + _NOT_IMPLEMENTED),
    "prompt_embeds": (_neutral(), "prompt_embeds " + _NOT_IMPLEMENTED + "; send token ids or text"),
    "logits_processors": (_neutral(), "logits_processors " + _NOT_IMPLEMENTED),
    "truncate_prompt_tokens": (_neutral(), "truncate_prompt_tokens " + _NOT_IMPLEMENTED + "; truncate the prompt "
                               "yourself"),
    "truncation_side": (_neutral(), "truncation_side (truncate_prompt_tokens) " + _NOT_IMPLEMENTED),
    "priority": (_neutral(0), "priority scheduling " + _NOT_IMPLEMENTED + " (requests are served first come, "
                 "first served); send priority 0 or none"),
    "kv_transfer_params": (_neutral(), "KV transfer (disaggregated serving) " + _NOT_IMPLEMENTED),
    "ec_transfer_params": (_neutral(), "encoder-cache transfer " + _NOT_IMPLEMENTED),
    "vllm_xargs": (_neutral(), "vllm_xargs (custom extensions) " + _NOT_IMPLEMENTED),
    "mm_processor_kwargs": (_neutral(), "multimodal inputs are not supported"),
    "media_io_kwargs": (_neutral(), "multimodal inputs are not supported"),
    "features": (_neutral(), "multimodal features are not supported"),
    "logprob_token_ids": (_neutral(), "logprob_token_ids " + _NOT_IMPLEMENTED + "; use logprobs / top_logprobs"),
    "watermarking": (_neutral(False), "watermarking " + _NOT_IMPLEMENTED),
    "repetition_detection": (_neutral(), "repetition_detection " + _NOT_IMPLEMENTED),
    "thinking_token_budget": (_neutral(), "thinking_token_budget " + _NOT_IMPLEMENTED + " (no reasoning parser)"),
    "reasoning_effort": (_neutral(), "reasoning_effort " + _NOT_IMPLEMENTED + " (no reasoning parser); pass "
                         "template variables in chat_template_kwargs"),
    "stream_interval": (_neutral(1), "stream_interval " + _NOT_IMPLEMENTED + " (each engine step is one chunk)"),
    "routed_experts_prompt_start": (_neutral(0), "routed experts are not returned (no MoE routing output)"),
    "return_token_offsets": (_neutral(False), "return_token_offsets " + _NOT_IMPLEMENTED),
    "return_prompt_text": (_neutral(False), "return_prompt_text " + _NOT_IMPLEMENTED),
    "return_mm_kwargs": (_neutral(True), "multimodal inputs are not supported"),
    "mm_hashes": (_neutral(), "multimodal inputs are not supported"),
}
# vLLM fields accepted without effect whatever their value: labels that change nothing in the output.
NO_EFFECT = frozenset(("user", "session_id", "include_reasoning"))


def check_request_fields(model_fields: Iterable[str], data: Any, kind: str) -> None:
    """Refuse the REFUSED fields of `data` (a request body) that ask for something; warn once about the keys no
    vLLM request model knows (module docstring). `model_fields`: the request model's own fields."""
    if not isinstance(data, dict):
        return
    known = set(model_fields)
    unknown = []
    for key, value in data.items():
        if key in known or key in NO_EFFECT:
            continue
        refusal = REFUSED.get(key)
        if refusal is None:
            unknown.append(key)
        elif not refusal[0](value) and not (key == "best_of" and value == data.get("n", 1)):
            raise VLLMValidationError(f"{key} is not supported: {refusal[1]}.", parameter=key)
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s (%s)",
                       set(unknown), kind)
