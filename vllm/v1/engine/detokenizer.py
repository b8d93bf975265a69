"""Incremental detokenization and stop-string detection, one instance per request.

Text is decoded over a sliding window of ids (the prefix/read offset technique): `prefix_offset..read_offset` is
text already emitted, `prefix_offset..` is decoded again with the new ids, and the difference is the new text.
A window whose text ends in U+FFFD (an incomplete UTF-8 character) emits nothing until later ids complete it.

Invariants:
- `output_text` is never half a character; once the request finishes it equals `tokenizer.decode(output ids)`
  for byte-level tokenizers (the window starts in the prompt so that leading-space rules see their context).
- `output_token_ids` keeps every id of the request, the stop token included; a stop string ends the request at
  the token that completes it: later ids of the same step are dropped, and the text is cut at the stop string
  (after it with `include_stop_str_in_output`).
- Stop strings are looked for only in the newly added text plus the `len(stop) - 1` characters before it; none
  before `min_tokens` output tokens.
- `get_next_output_text` holds back `output_text_buffer_length` characters until the request finishes, so a
  partial stop string is never streamed.
- Without a tokenizer (skip_tokenizer_init) or with `detokenize=False`, only ids are tracked and text stays "".
"""

from __future__ import annotations

from typing import Protocol

from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer

# How many prompt ids seed the decoding window (context for leading-space and merge rules).
_INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5


class _RequestLike(Protocol):
    prompt_token_ids: list[int]
    sampling_params: SamplingParams


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str],
                       include_in_output: bool) -> tuple[str, int] | None:
    """The earliest stop string that ends inside the last `new_char_count` characters, and where to cut the text.

    Returns (stop_str, truncate_to) with truncate_to the text length to keep, or None. Ties at one position go to
    the stop string listed first.
    """
    if new_char_count <= 0 or not stop:
        return None
    best: tuple[int, str] | None = None
    for stop_str in stop:
        start = max(0, len(output_text) - new_char_count - len(stop_str) + 1)
        index = output_text.find(stop_str, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop_str)
    if best is None:
        return None
    index, stop_str = best
    return stop_str, index + len(stop_str) if include_in_output else index


class IncrementalDetokenizer:
    """Tracks a request's output ids; the base class (no tokenizer) produces no text and no stop strings."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        self.stop_buffer_length = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False) -> str | None:
        """Append the step's ids; return the matched stop string, if one ended the request."""
        self.token_ids.extend(new_token_ids)
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to return now: everything so far, or only what is new since the last delta call."""
        buffer_length = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:end]
        start = self._last_output_text_offset
        if start >= end:
            return ""
        self._last_output_text_offset = end
        return self.output_text[start:end]

    @classmethod
    def from_new_request(cls, tokenizer: Tokenizer | None, request: _RequestLike,
                         like: IncrementalDetokenizer | None = None) -> IncrementalDetokenizer:
        """like: a detokenizer made for the same prompt and settings (a sibling of an n > 1 request), whose
        checked start of the window is reused instead of decoding the prompt's tail again."""
        params = request.sampling_params
        if tokenizer is None or not params.detokenize:
            return cls()
        prompt_window = like.prompt_window if isinstance(like, SlowIncrementalDetokenizer) else None
        return SlowIncrementalDetokenizer(tokenizer, request, prompt_window)


class SlowIncrementalDetokenizer(IncrementalDetokenizer):
    """Window decoding with a tokenizer, stop strings and the streaming hold-back."""

    def __init__(self, tokenizer: Tokenizer, request: _RequestLike,
                 prompt_window: tuple[int, ...] | None = None) -> None:
        super().__init__()
        params = request.sampling_params
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop: list[str] = list(params.stop or [])
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.output_text_buffer_length
        if prompt_window is None:
            prompt_tail = list(request.prompt_token_ids[-_INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
            if self.tokenizer.decode(prompt_tail, skip_special_tokens=self.skip_special_tokens).endswith("\ufffd"):
                # NOTE: a prompt ending in half a character would merge with the first output bytes; start clean.
                prompt_tail = []
            prompt_window = tuple(prompt_tail)
        # The checked start of the window (shared with siblings: see from_new_request).
        self.prompt_window = prompt_window
        # Prompt tail followed by the output ids: the ids the decoding window slides over.
        self._window_ids: list[int] = list(prompt_window)
        self.prefix_offset = 0
        self.read_offset = len(prompt_window)

    def _decode_window(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self._window_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def _decode_next(self, token_id: int) -> str:
        self._window_ids.append(token_id)
        prefix_text = self._decode_window(self.prefix_offset, self.read_offset)
        new_text = self._decode_window(self.prefix_offset, len(self._window_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._window_ids)
        return new_text[len(prefix_text):]

    def _flush(self) -> str:
        """At the end of the request, emit a trailing incomplete character as U+FFFD (what a full decode gives)."""
        if self.read_offset == len(self._window_ids):
            return ""
        prefix_text = self._decode_window(self.prefix_offset, self.read_offset)
        new_text = self._decode_window(self.prefix_offset, len(self._window_ids))
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._window_ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _append_and_check_stop(self, text: str) -> str | None:
        """Append `text`; on a stop string in it (or straddling its start) cut the output and return the string."""
        self.output_text += text
        if not text or not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        match = check_stop_strings(self.output_text, len(text), self.stop, self.include_stop_str_in_output)
        if match is None:
            return None
        stop_string, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        return stop_string

    def update(self, new_token_ids: list[int], stop_terminated: bool, finished: bool = False) -> str | None:
        skipped_stop_token_id: int | None = None
        if new_token_ids and stop_terminated and not self.include_stop_str_in_output:
            # NOTE: the EOS / stop token's own text is not part of the output (vLLM semantics); a special token
            # skipped by skip_special_tokens would decode to nothing anyway.
            skipped_stop_token_id = new_token_ids[-1]
            new_token_ids = new_token_ids[:-1]

        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            stop_string = self._append_and_check_stop(self._decode_next(token_id))
            if stop_string is not None:
                return stop_string

        if skipped_stop_token_id is not None:
            self.token_ids.append(skipped_stop_token_id)
        if finished or stop_terminated:
            return self._append_and_check_stop(self._flush())
        return None
