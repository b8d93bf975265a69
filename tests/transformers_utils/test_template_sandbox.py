"""The chat-template sandbox (template_sandbox.py) and the tokenizer's character bound, on CPU with the bundled tiny
model's tokenizer: templates within the bounds render exactly as Jinja's own sandbox renders them; each hostile
template stops with a TemplateBoundError (a ValueError through apply_chat_template), in bounded time and before
it builds its value; `max_token_chars` equals the longest vocabulary entry, counted here independently.
"""

from __future__ import annotations

import json
import os
import threading
import time

import jinja2
import jinja2.sandbox
import pytest

from vllm.config.model import default_model_path
from vllm.transformers_utils.template_sandbox import MAX_TEMPLATE_CHARS, TemplateBoundError
from vllm.transformers_utils.tokenizer import get_tokenizer

MSG = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer(default_model_path())


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{{ '%5d|%-4s'|format(3, 'ab') }}{{ 'a' ~ 'b' }}{{ [1, 2] * 2 }}{{ 2 ** 10 }}{{ 'x' * 3 }}{{ 'ab' + 'cd' }}",
    "{{ '{:>6}'.format('r') }}{{ 'a,b'.split(',')|join('-') }}{{ 'abc'|replace('b', 'BB') }}{{ 'x'|center(5) }}",
    "{% set ns = namespace(s='') %}{% for m in messages %}{% set ns.s = ns.s + m.content %}{% endfor %}{{ ns.s }}",
    "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% else %}{{ s|length }}{% endif %}{% endmacro %}"
    "{{ f('a', 10) }}",
    "{{ messages|tojson }}{{ bos_token }}{% if add_generation_prompt %}<a>{% endif %}",
])
def test_bounded_templates_render_as_jinja_does(tok, template: str) -> None:
    reference = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    reference.filters["tojson"] = lambda v: json.dumps(v)
    expected = reference.from_string(template).render(messages=MSG, add_generation_prompt=True,
                                                      **tok.special_tokens)
    assert tok.apply_chat_template(MSG, chat_template=template) == expected
    assert tok.apply_chat_template(MSG, chat_template=template, max_steps=100_000, timeout_s=10,
                                   cache_template=False) == expected


@pytest.mark.parametrize("template, needle", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    ("{{ 'a' * 10**10 }}", "repeated value of 10000000000"),
    ("{{ 10 ** (10 ** 10) }}", "10 ** 10000000000"),
    ("{{ 'x'|center(10**9) }}", "passed 1000000000"),
    ("{{ 'a'.ljust(10**9) }}", "passed 1000000000"),
    ("{{ '%0999999999d'|format(1) }}", "%-format"),
    ("{{ '%0999999999d' % 1 }}", "%-format"),
    ("{{ '{:>999999999}'.format(1) }}", "format spec"),
    ("{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 64) }}", "string of"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
     "concatenation of"),
    ("{% set s = 'a' * 3000 %}{{ s|replace('', s) }}", "replace"),
    ("{% set s = 'a' * 3000 %}{{ s.replace('', s) }}", "replace"),
    ("{{ (range(100000)|list * 50)|join }}", "repeated value of 5000000"),
    ("{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "an output of"),
])
def test_hostile_templates_stop_at_a_bound(tok, template: str, needle: str) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="chat template") as info:
        tok.apply_chat_template(MSG, chat_template=template, max_steps=2_000_000, timeout_s=20,
                                cache_template=False)
    assert isinstance(info.value.__cause__, TemplateBoundError)
    assert needle in str(info.value)
    assert time.monotonic() - started < 20


def test_step_budget_and_max_chars_are_per_render(tok) -> None:
    loops = "{% for i in range(1000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done"
    # Untraced (the server's own template), it runs to its end; with a budget it stops.
    assert tok.apply_chat_template(MSG, chat_template=loops) == "done"
    with pytest.raises(ValueError, match="more than 10000 steps"):
        tok.apply_chat_template(MSG, chat_template=loops, max_steps=10_000)
    # A smaller max_chars in one render does not leak into another thread's render.
    big = "{{ 'x' * 5000 }}"
    errors: list[BaseException] = []

    def other() -> None:
        try:
            assert len(tok.apply_chat_template(MSG, chat_template=big)) == 5000
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    with pytest.raises(ValueError, match="repeated value of 5000"):
        tok.apply_chat_template(MSG, chat_template=big, max_chars=4999)
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert not errors
    assert len(tok.apply_chat_template(MSG, chat_template="{{ 'x' * %d }}" % MAX_TEMPLATE_CHARS)) == \
        MAX_TEMPLATE_CHARS


def test_max_token_chars_is_the_longest_vocabulary_entry(tok) -> None:
    with open(os.path.join(default_model_path(), "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    entries = list(data["model"]["vocab"]) + [t["content"] for t in data.get("added_tokens", [])]
    assert tok.max_token_chars == max(len(e) for e in entries) == 93
    # The bound holds for a text that tokenizes into few tokens: no token covers more characters.
    for text in [" " * 500, "a" * 500, "hello world " * 50, "\n\n\n" * 100]:
        assert len(tok.encode(text, add_special_tokens=False)) * tok.max_token_chars >= len(text)
