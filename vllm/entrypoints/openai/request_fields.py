"""vLLM request fields this server does not implement (refused with a 400 naming them) and the warning for fields
no vLLM request model has (ignored, as vLLM does).

Every field of vLLM's CompletionRequest, ChatCompletionRequest, GenerateRequest, TokenizeRequest and
DetokenizeRequest is either a field of the request model here (implemented), or listed in `REFUSED`: sent with a
value that asks for nothing (None, its default, an empty list or dict) it is accepted, sent with any other value
it is a 400 whose `param` is the field's name. A field neither here nor in the model (a misspelling, a newer
OpenAI field) is ignored and logged with vLLM's warning, "The following fields were present in the request but
ignored: {...}". The table of docs/serving.md lists them all.

`check_request_fields` runs before pydantic validates a request (RequestModel's wrap validator in protocol_base.py),
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


_STRUCTURED = ("structured outputs (response_format, guided_*, structured_outputs) are not implemented (the "
               "sampling mask would have to be the support after the grammar)")
_MULTIMODAL = "multimodal inputs are not supported"
_HERE = "this engine does not implement it on this endpoint"

# field -> (value that asks for nothing, why it is refused otherwise); the error is "{field} is not supported: {why}."
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "response_format": (_text_format, _STRUCTURED + '; send no response_format or {"type": "text"}'),
    "structured_outputs": (_neutral(), _STRUCTURED),
    "guided_json": (_neutral(), _STRUCTURED),
    "guided_regex": (_neutral(), _STRUCTURED),
    "guided_choice": (_neutral(), _STRUCTURED),
    "guided_grammar": (_neutral(), _STRUCTURED),
    "structural_tag": (_neutral(), _STRUCTURED),
    "guided_decoding_backend": (_neutral(), _STRUCTURED),
    "guided_whitespace_pattern": (_neutral(), _STRUCTURED),
    "use_beam_search": (_neutral(False), "this engine has no beam search"),
    "length_penalty": (_neutral(1.0), "it is a beam-search setting and this engine has no beam search"),
    "best_of": (_neutral(1), "as in vLLM v1, set n to the number of samples you want and rank them yourself"),
    "suffix": (_neutral(), "this engine has no fill-in-the-middle"),
    "prompt_embeds": (_neutral(), "prompts are text or token ids here"),
    "logits_processors": (_neutral(), "this engine runs no custom logits processors"),
    "truncate_prompt_tokens": (_neutral(), "prompts are not truncated here; truncate the prompt yourself"),
    "truncation_side": (_neutral(), "prompts are not truncated here"),
    "priority": (_neutral(0), "requests are served first come, first served (no priority scheduling); send 0 or "
                 "nothing"),
    "kv_transfer_params": (_neutral(), "this engine has no KV transfer (disaggregated serving)"),
    "ec_transfer_params": (_neutral(), "this engine has no encoder-cache transfer"),
    "vllm_xargs": (_neutral(), "this engine has no custom request extensions"),
    "mm_processor_kwargs": (_neutral(), _MULTIMODAL),
    "media_io_kwargs": (_neutral(), _MULTIMODAL),
    "features": (_neutral(), _MULTIMODAL),
    "mm_hashes": (_neutral(), _MULTIMODAL),
    "return_mm_kwargs": (_neutral(True), _MULTIMODAL),
    "logprob_token_ids": (_neutral(), "use logprobs / top_logprobs"),
    "watermarking": (_neutral(False), "this engine has no watermarking"),
    "repetition_detection": (_neutral(), "this engine has no repetition detection"),
    "thinking_token_budget": (_neutral(), "this engine has no reasoning parser"),
    "reasoning_effort": (_neutral(), "this engine has no reasoning parser; pass template variables in "
                         "chat_template_kwargs"),
    "stream_interval": (_neutral(1), "each engine step is one streamed chunk"),
    "routed_experts_prompt_start": (_neutral(0), "this engine returns no expert routing"),
    "return_token_offsets": (_neutral(False), "this engine returns no token offsets"),
    "return_prompt_text": (_neutral(False), "use /tokenize or return_token_ids to see the prompt"),
    # Fields of some vLLM requests only; where a request model here has the field, it is implemented there.
    "echo": (_neutral(False), _HERE),
    "add_special_tokens": (_neutral(True), _HERE),
    "prompt_logprobs": (_neutral(), _HERE),
    "return_tokens_as_token_ids": (_neutral(False), _HERE),
    "cache_salt": (_neutral(), _HERE),
    "logit_bias": (_neutral(), _HERE),
    "bad_words": (_neutral(), _HERE),
    "allowed_token_ids": (_neutral(), _HERE),
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
