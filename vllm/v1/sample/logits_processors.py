"""Request-side preparation of the token-id sampling fields: the checks that need the vocabulary or the tokenizer.

`prepare_token_fields` runs in the input processor, before a request reaches the engine core: it refuses token
ids outside the model's vocabulary in `logit_bias` and `allowed_token_ids` (VLLMValidationError naming the field,
HTTP 400), and tokenizes `bad_words` as vLLM does (`SamplingParams.update_from_tokenizer`): each word without its
leading spaces, and again with one leading space when that gives a different first token and the same number of
tokens (the word in the middle of a text). The device side is vllm/v1/sample/ops/penalties.py.
"""

from __future__ import annotations

from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams


def prepare_token_fields(params: SamplingParams, vocab_size: int, tokenizer: Any) -> None:
    """Check `params` (a clone the caller owns) against the vocabulary and set `_bad_words_token_ids`."""
    if params.logit_bias:
        bad = sorted(t for t in params.logit_bias if t >= vocab_size)
        if bad:
            raise VLLMValidationError(f"token_id(s) {bad[:10]} in logit_bias contain out-of-vocab token ids. "
                                      f"Vocabulary size: {vocab_size}", parameter="logit_bias", value=bad[0])
    if params.allowed_token_ids is not None:
        bad = sorted(t for t in params.allowed_token_ids if t >= vocab_size)
        if bad:
            raise VLLMValidationError(f"allowed_token_ids contains out-of-vocab token id(s) {bad[:10]}. "
                                      f"Vocabulary size: {vocab_size}", parameter="allowed_token_ids",
                                      value=bad[0])
    if not params.bad_words:
        params._bad_words_token_ids = None
        return
    if tokenizer is None:
        raise VLLMValidationError("bad_words needs the tokenizer (the engine was started with "
                                  "skip_tokenizer_init).", parameter="bad_words")
    words: list[list[int]] = []
    for word in params.bad_words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise VLLMValidationError(f"bad_words entry {word!r} has no tokens.", parameter="bad_words",
                                      value=word)
        words.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            words.append(list(spaced))
    bad = sorted({t for w in words for t in w if not 0 <= t < vocab_size})
    if bad:
        raise VLLMValidationError(f"bad_words tokenize to out-of-vocab token id(s) {bad[:10]}. Vocabulary size: "
                                  f"{vocab_size}", parameter="bad_words")
    params._bad_words_token_ids = words
