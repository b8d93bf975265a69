"""InputProcessor: a user prompt and SamplingParams -> a validated EngineCoreRequest.

Every check on a request happens here, before the request reaches the engine core, and fails with a
VLLMValidationError (a ValueError naming the field) that says what to change (HTTP 400 at the server); a rejected
request leaves the engine untouched.

Invariants of the returned request:
- `prompt_token_ids` is non-empty, every id is an int in [0, vocab_size), and `len(prompt) < max_model_len`; a text
  prompt is valid Unicode (no lone surrogates, which the tokenizer cannot take).
- `sampling_params` is a copy (the caller's object is never mutated) with `max_tokens` resolved:
  None -> max_model_len - prompt_len; a larger value is capped so that prompt + output fits, as vLLM's LLM and
  AsyncLLM do. The OpenAI server refuses such a request instead, before adding it (`check_max_tokens`, vLLM's
  400 and message).
- `sampling_params.return_sampling_mask` is resolved to a bool: True iff the engine flag is on and the request
  did not opt out.
- `cache_salt` is None or a non-empty string (a prompt dict's "cache_salt").
- `eos_token_id` is the tokenizer's EOS (or generation_config.json / config.json's when there is no tokenizer);
  the other generation-config EOS ids are added to the stop token ids unless `ignore_eos`.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.inputs import PROMPT_KEYS, PromptType
from vllm.sampling_params import _SAMPLING_EPS, SamplingParams, check_unicode
from vllm.transformers_utils.tokenizer import Tokenizer, read_generation_eos_token_ids
from vllm.utils import refuse_lora_request
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.sample.logits_processors import prepare_token_fields


def check_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int,
                     parameter: str = "max_tokens") -> None:
    """The OpenAI server's rule (vLLM's, with its message, which clients parse): `max_tokens` may not exceed the
    context the prompt leaves, `max_model_len - num_prompt_tokens`. A prompt that leaves no room at all is the
    input processor's error, not this one."""
    if max_tokens is None or num_prompt_tokens >= max_model_len:
        return
    room = max_model_len - num_prompt_tokens
    if max_tokens > room:
        raise VLLMValidationError(
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum context "
            f"length is {max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
            f"({max_tokens} > {max_model_len} - {num_prompt_tokens}).", parameter=parameter, value=max_tokens)


def check_cache_salt(cache_salt: object) -> str | None:
    """vLLM's rule for `cache_salt`: None, or a non-empty string (valid Unicode: it is hashed as UTF-8)."""
    if cache_salt is None:
        return None
    if not isinstance(cache_salt, str) or not cache_salt:
        raise VLLMValidationError("Parameter 'cache_salt' must be a non-empty string if provided.",
                                  parameter="cache_salt")
    check_unicode(cache_salt, "cache_salt")
    return cache_salt


def _asks_for_nothing(value: object) -> bool:
    """A prompt key set to None or to an empty container ({}, [], ()) asks for nothing: verl sends
    `TokensPrompt(prompt_token_ids=..., multi_modal_data={})` with every text request."""
    return value is None or (isinstance(value, (dict, list, tuple)) and not value)


class InputProcessor:
    """Validates and tokenizes requests for one engine (its model config and tokenizer)."""

    def __init__(self, vllm_config: VllmConfig, tokenizer: Tokenizer | None) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.tokenizer = tokenizer
        max_model_len = self.model_config.max_model_len
        assert max_model_len is not None
        self.max_model_len: int = max_model_len
        self.eos_token_id, self.generation_eos_token_ids = self._resolve_eos_token_ids()

    def _resolve_eos_token_ids(self) -> tuple[int | None, list[int]]:
        """The main EOS id and every generation-config EOS id."""
        model_path = str(self.model_config.model)
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_id, sorted(self.tokenizer.get_eos_token_ids())
        generation_eos = read_generation_eos_token_ids(model_path)
        config_eos = getattr(self.model_config.hf_config, "eos_token_id", None)
        if isinstance(config_eos, list):
            config_eos = config_eos[0] if config_eos else None
        eos_token_id = int(config_eos) if config_eos is not None else (generation_eos[0] if generation_eos else None)
        return eos_token_id, generation_eos

    def _tokenize(self, prompt: PromptType, add_special_tokens: bool) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            text: str | None = prompt
            token_ids: list[int] | None = None
        elif isinstance(prompt, dict):
            unknown = [k for k in prompt.keys() - PROMPT_KEYS if not _asks_for_nothing(prompt[k])]
            if unknown:
                names = ", ".join(sorted(map(repr, unknown)))
                raise VLLMValidationError(
                    f"Unsupported prompt key(s): {names}. This engine takes only 'prompt' (text) and "
                    "'prompt_token_ids' (list of ints), with an optional 'cache_salt': it has no multimodal inputs, "
                    "prompt embeddings or encoder-decoder prompts. Remove the key(s), or leave them None or empty.",
                    parameter=str(sorted(unknown)[0]))
            text = prompt.get("prompt")
            token_ids = prompt.get("prompt_token_ids")
            if text is None and token_ids is None:
                raise VLLMValidationError("A prompt dict needs a 'prompt' (text) or a 'prompt_token_ids' (list of "
                                          "ints) key.", parameter="prompt")
            if text is not None and not isinstance(text, str):
                raise VLLMValidationError(f"'prompt' must be a string, got {type(text).__name__}.",
                                          parameter="prompt")
        else:
            raise VLLMValidationError(f"A prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': "
                                      f"[int, ...]}}, got {type(prompt).__name__}.", parameter="prompt")
        if token_ids is not None:
            if not isinstance(token_ids, list) or any(isinstance(t, bool) or not isinstance(t, int)
                                                      for t in token_ids):
                raise VLLMValidationError("'prompt_token_ids' must be a list of integers.",
                                          parameter="prompt_token_ids")
            return list(token_ids), text
        assert text is not None
        if self.tokenizer is None:
            raise VLLMValidationError("The engine runs with skip_tokenizer_init, so prompts must be token ids: pass "
                                      "{'prompt_token_ids': [...]} instead of text.", parameter="prompt")
        check_unicode(text, "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens), text

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise VLLMValidationError("The prompt is empty: send at least one token.", parameter="prompt")
        vocab_size = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise VLLMValidationError(f"Prompt token id {bad[0]} is out of vocabulary range [0, {vocab_size}).",
                                      parameter="prompt_token_ids", value=bad[0])
        prompt_len = len(prompt_token_ids)
        if prompt_len >= self.max_model_len:
            raise VLLMValidationError(f"The prompt ({prompt_len} tokens) is longer than the maximum model length of "
                             f"{self.max_model_len} tokens, leaving no room for an output token. Make the prompt "
                             "shorter or start the engine with a larger --max-model-len.", parameter="prompt")

    def _validate_params(self, params: SamplingParams) -> None:
        max_logprobs = self.model_config.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise VLLMValidationError(f"Requested logprobs={params.logprobs}, more than the maximum of "
                                      f"{max_logprobs}; ask for fewer or start the engine with a larger "
                                      "--max-logprobs.", parameter="logprobs", value=params.logprobs)
        if params.prompt_logprobs is not None:
            num = self.model_config.vocab_size if params.prompt_logprobs == -1 else params.prompt_logprobs
            if num > max_logprobs:
                raise VLLMValidationError(f"Requested prompt_logprobs={params.prompt_logprobs} ({num} per position), "
                                          f"more than the maximum of {max_logprobs}; ask for fewer or start the "
                                          "engine with a larger --max-logprobs.", parameter="prompt_logprobs",
                                          value=params.prompt_logprobs)
        if params.stop and (self.tokenizer is None or not params.detokenize):
            raise VLLMValidationError("Stop strings need detokenized text: drop 'stop', or set detokenize=True on "
                                      "an engine that loads its tokenizer (no skip_tokenizer_init); stop_token_ids "
                                      "work without text.", parameter="stop")
        engine_masks = self.model_config.return_sampling_mask
        if params.return_sampling_mask and not engine_masks:
            raise VLLMValidationError("return_sampling_mask=True was requested, but this engine does not return "
                                      "sampling masks: start the engine with --return-sampling-mask (LLM(..., "
                                      "return_sampling_mask=True)).", parameter="return_sampling_mask")
        if engine_masks and params.return_sampling_mask is not False:
            if params.temperature < _SAMPLING_EPS or params.top_k <= 0:
                raise VLLMValidationError(
                    "This engine returns sampling masks (--return-sampling-mask), which requires temperature > 0 "
                    f"and top_k > 0 (top_k bounds the mask's size); got temperature={params.temperature}, "
                    f"top_k={params.top_k}. Set both, or opt this request out with return_sampling_mask=False.",
                    parameter="temperature" if params.temperature < _SAMPLING_EPS else "top_k")

    def process_inputs(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None, add_special_tokens: bool = True, *,
                       lora_request: Any = None, priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """Validate and tokenize one request; returns it with the prompt text (None for token-id prompts).

        `add_special_tokens=False` is for prompts already rendered by a chat template (which writes its own BOS).
        `lora_request` and `priority` are vLLM's; only their defaults (None, 0) are accepted.
        """
        if not isinstance(params, SamplingParams):
            raise VLLMValidationError(f"params must be SamplingParams, got {type(params).__name__}.")
        refuse_lora_request(lora_request)
        if priority != 0:
            raise VLLMValidationError(f"priority={priority!r} is not supported: requests are scheduled first come, "
                                      "first served (no priority scheduling); pass priority=0.", parameter="priority")
        prompt_token_ids, prompt_text = self._tokenize(prompt, add_special_tokens)
        cache_salt = check_cache_salt(prompt.get("cache_salt") if isinstance(prompt, dict) else None)
        self._validate_prompt(prompt_token_ids)
        self._validate_params(params)

        params = params.clone()
        prompt_len = len(prompt_token_ids)
        room = self.max_model_len - prompt_len
        params.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        params.min_tokens = min(params.min_tokens, params.max_tokens)
        prepare_token_fields(params, self.model_config.vocab_size, self.tokenizer)
        params.return_sampling_mask = bool(self.model_config.return_sampling_mask
                                           and params.return_sampling_mask is not False)
        if not params.ignore_eos:
            extra_eos = [t for t in self.generation_eos_token_ids if t != self.eos_token_id]
            if extra_eos:
                stop_ids = list(params.stop_token_ids or [])
                params.stop_token_ids = stop_ids + [t for t in extra_eos if t not in stop_ids]
                params._all_stop_token_ids = set(params._all_stop_token_ids) | set(extra_eos)

        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time if arrival_time is not None else time.time(),
            cache_salt=cache_salt,
        )
        return request, prompt_text
