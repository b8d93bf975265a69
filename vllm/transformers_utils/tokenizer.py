"""Tokenizer: a thin wrapper over `tokenizers.Tokenizer` that reads a Hugging Face tokenizer folder.

Reads `tokenizer.json` (required), `tokenizer_config.json` (special tokens as strings or AddedToken dicts,
`add_bos_token`, `add_eos_token`, `chat_template`, `model_max_length`), `chat_template.jinja` and
`generation_config.json` (`eos_token_id`, an int or a list) when present. transformers is never imported.

Invariants:
- `encode(text)` equals transformers' `PreTrainedTokenizerFast.encode(text)` for the same folder; BOS/EOS are added
  only when the config asks for them and `tokenizer.json`'s post-processor does not already add them.
- `decode` delegates to `tokenizers` (no `clean_up_tokenization_spaces`), so that decoding a sequence piecewise
  (see `vllm.v1.engine.detokenizer`) gives the same text as decoding it whole.
- Chat templates render in a sandboxed Jinja environment (template_sandbox.py): a template can only read the
  variables passed to it and builds no value or output over MAX_TEMPLATE_CHARS; `max_steps` also bounds its work
  (the server passes it for templates a request sent).
- `max_token_chars` bounds the characters one token can stand for, so a text of more than
  `max_model_len * max_token_chars` characters is longer than the context without tokenizing it (None when the
  tokenizer drops input characters, e.g. whitespace-splitting BERT-style ones: no such bound then).
"""

from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
from tokenizers import Tokenizer as _HFTokenizer

from vllm.transformers_utils.template_sandbox import BoundedSandbox, render_bounded

# Texts longer than this are encoded with the GIL released (Tokenizer.encode).
_GIL_FREE_CHARS = 4096

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, an AddedToken dict, or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"Cannot read special token {value!r}: expected a string or a dict with 'content'.")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def read_generation_eos_token_ids(folder: str) -> list[int]:
    """`eos_token_id` of `generation_config.json` in `folder` (an int or a list), or [] when absent."""
    eos = _read_json(os.path.join(folder, "generation_config.json")).get("eos_token_id")
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # NOTE: Jinja's builtin tojson HTML-escapes <, >, & and '; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """The tokenizer of one model folder (see the module docstring for what is read)."""

    def __init__(self, path: str) -> None:
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise ValueError(f"No tokenizer.json in {path!r}: the tokenizer must be a local folder in Hugging Face "
                             "format with a tokenizer.json (slow sentencepiece-only tokenizers are not supported).")
        self.name_or_path = path
        self._tokenizer = _HFTokenizer.from_file(tokenizer_file)
        # NOTE: some tokenizer.json files carry truncation/padding settings; transformers turns them off by default.
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        config = _read_json(os.path.join(path, "tokenizer_config.json"))

        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_TOKEN_KEYS:
            content = _token_content(config.get(key))
            if content is not None:
                self.special_tokens[key] = content
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.bos_token_id: int | None = self._token_id(self.bos_token)
        self._generation_eos_token_ids = read_generation_eos_token_ids(path)
        eos_token_id = self._token_id(self.eos_token)
        if eos_token_id is None and self._generation_eos_token_ids:
            eos_token_id = self._generation_eos_token_ids[0]
            self.eos_token = self._tokenizer.id_to_token(eos_token_id)
        self.eos_token_id: int | None = eos_token_id

        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.add_eos_token = bool(config.get("add_eos_token", False))
        probe = self._tokenizer.encode("", add_special_tokens=True).ids
        self._post_processor_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self._post_processor_adds_eos = self.eos_token_id is not None and probe[-1:] == [self.eos_token_id]

        max_len = config.get("model_max_length")
        self.model_max_length: int | None = int(max_len) if isinstance(max_len, (int, float)) and max_len < 1e12 \
            else None
        self.chat_template: str | dict[str, str] | None = self._load_chat_template(path, config)

    @staticmethod
    def _load_chat_template(path: str, config: dict[str, Any]) -> str | dict[str, str] | None:
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                return f.read()
        template = config.get("chat_template")
        if template is None:
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        if isinstance(template, list):
            return {t["name"]: t["template"] for t in template}
        return template

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._tokenizer.token_to_id(token)

    # ---- encoding / decoding ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > _GIL_FREE_CHARS:
            # NOTE: `tokenizers`' encode holds the GIL for the whole text (a 180k-character prompt: ~80 ms in which
            # the server's event loop cannot run, though it is tokenized in a pool thread); encode_batch releases it.
            ids = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self.add_bos_token and not self._post_processor_adds_bos and self.bos_token_id is not None:
                ids = [self.bos_token_id] + ids
            if self.add_eos_token and not self._post_processor_adds_eos and self.eos_token_id is not None:
                ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids: list[int], skip_special_tokens: bool = False) -> list[str]:
        """Each id decoded on its own (the `decoded_token` of logprobs)."""
        return self._tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int | None]:
        return [self._tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @cached_property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of input text one token can stand for (module docstring), or None."""
        # NOTE: a vocabulary entry is at least as long as the text it decodes to (byte-level entries spell one
        # character per byte, "<0x0A>" six for one); added tokens match their content.
        longest = max((len(t) for t in self.get_vocab()), default=1)
        probe = " \t\n\r\x00\u200b\u3000\xa0" * 8
        if len(self.encode(probe, add_special_tokens=False)) * longest < len(probe):
            return None
        return max(longest, 1)

    @cached_property
    def all_special_ids(self) -> list[int]:
        """Ids of the configured special tokens and of every added token flagged special, ascending."""
        ids = {i for i, tok in self._tokenizer.get_added_tokens_decoder().items() if tok.special}
        ids.update(i for i in (self._token_id(t) for t in self.special_tokens.values()) if i is not None)
        return sorted(ids)

    def get_eos_token_ids(self) -> set[int]:
        """The tokenizer's EOS plus every `eos_token_id` of generation_config.json."""
        ids = set(self._generation_eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return ids

    # ---- chat ----

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        template = chat_template if chat_template is not None else self.chat_template
        if isinstance(template, dict):
            if tools and "tool_use" in template:
                template = template["tool_use"]
            elif "default" in template:
                template = template["default"]
            else:
                raise ValueError(f"The tokenizer has named chat templates {sorted(template)} but no 'default' one; "
                                 "pass chat_template= explicitly.")
        if not template:
            raise ValueError(f"The tokenizer at {self.name_or_path!r} has no chat template (no chat_template in "
                             "tokenizer_config.json and no chat_template.jinja): pass a chat template explicitly "
                             "(--chat-template or chat_template=...), or send a plain text prompt.")
        return template

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            max_steps: int | None = None, timeout_s: float | None = None,
                            max_chars: int | None = None, cache_template: bool = True,
                            **kwargs: Any) -> str | list[int]:
        """Render `messages` with the chat template; token ids (no extra BOS) when `tokenize`. With `max_steps`,
        compiling and rendering stop after that many Python line events or `timeout_s` (untrusted templates);
        `max_chars` bounds the values and output it builds (default MAX_TEMPLATE_CHARS); `cache_template=False`
        compiles the template for this call only (one a request sent)."""
        template = self._select_template(chat_template, kwargs.get("tools"))
        variables = {"messages": messages, "add_generation_prompt": add_generation_prompt,
                     **self.special_tokens, **kwargs}
        try:
            rendered = render_bounded(template, variables, max_steps, timeout_s,
                                      functools.partial(_compile_template, cache=cache_template), max_chars,
                                      dispose=not cache_template)
        except jinja2.exceptions.TemplateError as e:
            # NOTE: templates raise_exception() on malformed conversations (user input), hence ValueError.
            raise ValueError(f"The chat template rejected the messages: {e}") from e
        if tokenize:
            # NOTE: the template writes the BOS itself when the model wants one.
            return self.encode(rendered, add_special_tokens=False)
        return rendered


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}
_TEMPLATE_CACHE_SIZE = 16
_ENV: BoundedSandbox | None = None


def _environment() -> BoundedSandbox:
    # NOTE: one environment for every template: a new one per template would be cyclic garbage each time.
    global _ENV
    if _ENV is None:
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.add_filter("tojson", _tojson)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


def _compile_template(source: str, cache: bool = True) -> jinja2.Template:
    """The compiled template, from the cache of the last few when `cache` (the server's and offline callers'
    templates); a request's template is compiled for its render only (a cache of them would keep each one's
    compilation memory)."""
    template = _TEMPLATE_CACHE.get(source) if cache else None
    if template is None:
        try:
            template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"The chat template is not valid Jinja: {e}") from e
        if cache:
            if len(_TEMPLATE_CACHE) >= _TEMPLATE_CACHE_SIZE:
                del _TEMPLATE_CACHE[next(iter(_TEMPLATE_CACHE))]
            _TEMPLATE_CACHE[source] = template
    return template


def get_tokenizer(path: str) -> Tokenizer:
    """Load the tokenizer of a local Hugging Face folder (there is no model hub at run time)."""
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ValueError(f"Tokenizer path {path!r} is not a local folder (there is no model hub at run time).")
    return Tokenizer(path)
