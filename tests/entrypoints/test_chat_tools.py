"""Chat tools (issue 26): the Hermes parser on text (hand-worked cases), and the endpoint wiring replayed with
the openai client against the app in-process, over an engine stub that returns a scripted text (the bundled tiny
model never writes a tool call by itself). The prompt the template renders with `tools` is checked against
transformers' apply_chat_template on the same template."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import types
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from vllm.config import ModelConfig
from vllm.entrypoints.openai.api_server import build_app
from vllm.entrypoints.openai.tool_parsers import Hermes2ProToolParser
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import get_tokenizer

from tests.entrypoints.conftest import MODEL

TEMPLATE_FILE = os.path.join(os.path.dirname(__file__), "assets", "hermes_tools.jinja")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL_TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>')


# ---------------------------------------------------------------- the parser on text

def test_hermes_no_call_is_content() -> None:
    info = Hermes2ProToolParser().extract_tool_calls("Just text <tool> not a call")
    assert not info.tools_called and info.tool_calls == [] and info.content == "Just text <tool> not a call"


def test_hermes_calls_and_content() -> None:
    info = Hermes2ProToolParser().extract_tool_calls(CALL_TEXT)
    assert info.tools_called and info.content == "Let me look.\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls] == [
        ("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert info.tool_calls[0].function.arguments == '{"city": "Zürich"}'  # non-ASCII kept, json.dumps spacing
    assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in info.tool_calls)
    assert len({c.id for c in info.tool_calls}) == 2


def test_hermes_unclosed_last_call_and_no_content() -> None:
    info = Hermes2ProToolParser().extract_tool_calls('<tool_call>{"name": "f", "arguments": {"x": [1, 2]}}')
    assert info.tools_called and info.content is None
    assert info.tool_calls[0].function.name == "f" and json.loads(info.tool_calls[0].function.arguments) == {
        "x": [1, 2]}


@pytest.mark.parametrize("bad", ['<tool_call>{"name": "f"}</tool_call>', "<tool_call>not json</tool_call>",
                                 '<tool_call>["f"]</tool_call>'])
def test_hermes_malformed_call_is_all_content(bad: str) -> None:
    info = Hermes2ProToolParser().extract_tool_calls("a " + bad)
    assert not info.tools_called and info.content == "a " + bad


def test_hermes_parallel_tool_calls_false_keeps_first() -> None:
    info = Hermes2ProToolParser(parallel_tool_calls=False).extract_tool_calls(CALL_TEXT)
    assert [json.loads(c.function.arguments)["city"] for c in info.tool_calls] == ["Zürich"]


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_hermes_stream_matches_whole_text(step: int) -> None:
    parser = Hermes2ProToolParser()
    state = parser.stream_state()
    content, calls = "", []
    for i in range(0, len(CALL_TEXT), step):
        text, new = state.feed(CALL_TEXT[i:i + step])
        content += text or ""
        calls += new
    text, new = state.finish()
    content += text or ""
    calls += new
    whole = parser.extract_tool_calls(CALL_TEXT)
    assert content == whole.content and state.tools_called
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(whole.tool_calls)]


def test_hermes_stream_holds_back_a_possible_tag_then_releases_it() -> None:
    state = Hermes2ProToolParser().stream_state()
    assert state.feed("x <tool") == ("x ", [])
    assert state.feed("box>") == ("<toolbox>", [])
    assert state.finish() == (None, [])
    assert not state.tools_called


# ---------------------------------------------------------------- the endpoint, over an engine stub

class _Stream:
    def __init__(self, outputs: list[RequestOutput]) -> None:
        self.outputs = outputs

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._gen()

    async def _gen(self) -> AsyncIterator[RequestOutput]:
        for out in self.outputs:
            yield out

    def close(self) -> None:
        pass


class StubEngine:
    """What build_app and the handlers read of an AsyncLLM; every request "generates" `self.text`, in pieces of
    `self.step` characters when streamed."""

    def __init__(self, text: str = CALL_TEXT, step: int = 7) -> None:
        self.model_config = ModelConfig(model=MODEL, max_model_len=2048)
        self.tokenizer = get_tokenizer(MODEL)
        self.text, self.step = text, step
        self.added: list[tuple[list[int], SamplingParams]] = []
        self.errored = False
        self.engine_core = types.SimpleNamespace(data_parallel_size=1)  # the X-data-parallel-rank check reads it

    async def add_request(self, request_id: str, prompt: dict[str, Any], params: SamplingParams) -> str:
        self.added.append((prompt["prompt_token_ids"], params))
        return request_id

    def stream_outputs(self, request_id: str, queue: Any) -> _Stream:
        params = self.added[-1][1]
        pieces = [self.text[i:i + self.step] for i in range(0, len(self.text), self.step)]
        if params.output_kind.name != "DELTA":
            pieces = [self.text]
        outs = [RequestOutput(request_id, None, self.added[-1][0], None, [CompletionOutput(
            0, piece, [5] * len(piece), None, None, finish_reason="stop" if i == len(pieces) - 1 else None)],
            i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        return _Stream(outs)

    async def abort(self, request_ids: Any) -> None:
        pass


def _client(app: Any) -> openai.AsyncOpenAI:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)


def _app(engine: StubEngine, **kwargs: Any) -> Any:
    return build_app(engine, chat_template=TEMPLATE_FILE, **kwargs)


MESSAGES = [{"role": "user", "content": "Weather in Zürich?"}]


def test_tool_calls_whole_response_with_the_openai_client() -> None:
    engine = StubEngine()
    app = _app(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")

    async def main() -> Any:
        return await _client(app).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                          tools=TOOLS, temperature=0.7)
    resp = asyncio.run(main())
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look.\n"
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("function", "get_weather", {"city": "Zürich"}), ("function", "get_weather", {"city": "Oslo", "days": 2})]
    # vLLM's hermes parser keeps special tokens in the text it reads
    assert engine.added[-1][1].skip_special_tokens is False


def test_tools_reach_the_template_as_transformers_renders_them() -> None:
    transformers = pytest.importorskip("transformers")
    engine = StubEngine()
    app = _app(engine, enable_auto_tool_choice=True, tool_call_parser="hermes")
    with open(TEMPLATE_FILE) as f:
        template = f.read()

    async def main() -> None:
        await _client(app).chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS)
    asyncio.run(main())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
    # NOTE: the server passes each tool with vLLM's fields filled (description / parameters None when absent).
    expected = hf.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=template, tokenize=True,
                                      add_generation_prompt=True)
    expected = expected["input_ids"] if isinstance(expected, dict) or hasattr(expected, "keys") else expected
    assert engine.added[-1][0] == list(expected)
    assert "<tools>" in engine.tokenizer.decode(engine.added[-1][0])


@pytest.mark.parametrize("step", [1, 4, 9])
def test_tool_calls_streamed_with_the_openai_client(step: int) -> None:
    app = _app(StubEngine(step=step), enable_auto_tool_choice=True, tool_call_parser="hermes")

    async def main() -> list[Any]:
        stream = await _client(app).chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                            stream=True)
        return [chunk async for chunk in stream]
    chunks = asyncio.run(main())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += call.id or ""
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
    assert content == "Let me look.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "Oslo", "days": 2})]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in calls.values())
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_returns_the_text() -> None:
    app = _app(StubEngine(), enable_auto_tool_choice=True, tool_call_parser="hermes")

    async def main() -> Any:
        return await _client(app).chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                          tool_choice="none")
    choice = asyncio.run(main()).choices[0]
    assert choice.message.content == CALL_TEXT and not choice.message.tool_calls and choice.finish_reason == "stop"


def _post(app: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    async def main() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return await http.post(path, json=body)
    return asyncio.run(main())


def test_auto_without_the_flag_is_vllms_400() -> None:
    app = _app(StubEngine())
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, **body})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set')
        assert r.json()["error"]["param"] == "tool_choice"
    # tool_choice "none" works without the flag; tools still reach the template, as in vLLM
    assert _post(app, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS,
                                               "tool_choice": "none"}).status_code == 200


@pytest.mark.parametrize("choice,named", [("required", "required"),
                                          ({"type": "function", "function": {"name": "get_weather"}},
                                           "get_weather")])
def test_required_and_named_tool_choice_are_refused(choice: Any, named: str) -> None:
    app = _app(StubEngine(), enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert named in r.json()["error"]["message"] and "structured outputs" in r.json()["error"]["message"]


def test_tool_choice_without_tools_is_refused() -> None:
    app = _app(StubEngine(), enable_auto_tool_choice=True, tool_call_parser="hermes")
    r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"})
    assert r.status_code == 400 and "`tools` must be set" in r.json()["error"]["message"]


def test_unknown_parser_and_flag_without_parser_fail_at_start() -> None:
    with pytest.raises(ValueError, match="hermes"):
        _app(StubEngine(), enable_auto_tool_choice=True, tool_call_parser="mistral")
    with pytest.raises(ValueError, match="--tool-call-parser"):
        _app(StubEngine(), enable_auto_tool_choice=True)


# ---------------------------------------------------------------- request fields, over the same stub

@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": MESSAGES, "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": MESSAGES, "structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "hi", "priority": 1}, "priority"),
    ("/v1/chat/completions", {"messages": MESSAGES, "truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logits_processors": ["a.b"]}, "logits_processors"),
    ("/inference/v1/generate", {"token_ids": [1, 2], "kv_transfer_params": {"a": 1}}, "kv_transfer_params"),
    ("/tokenize", {"prompt": "hi", "mm_processor_kwargs": {"a": 1}}, "mm_processor_kwargs"),
])
def test_refused_fields_are_400s_naming_them(path: str, body: dict[str, Any], field: str) -> None:
    r = _post(_app(StubEngine()), path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field} is not supported")


@pytest.mark.parametrize("body", [{"response_format": {"type": "text"}}, {"use_beam_search": False},
                                  {"best_of": 1}, {"priority": 0}, {"guided_json": None}, {"logits_processors": []}])
def test_refused_fields_asking_for_nothing_are_accepted(body: dict[str, Any]) -> None:
    assert _post(_app(StubEngine()), "/v1/completions", {"prompt": "hi", **body}).status_code == 200


def test_unknown_fields_are_ignored_with_vllms_warning(caplog: pytest.LogCaptureFixture) -> None:
    app = _app(StubEngine())
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.protocol"):
        r = _post(app, "/v1/chat/completions", {"messages": MESSAGES, "temprature": 0.5, "metadata": {"a": "b"}})
    assert r.status_code == 200
    warnings = [rec.getMessage() for rec in caplog.records
                if "were present in the request but ignored" in rec.getMessage()]
    assert len(warnings) == 1 and "temprature" in warnings[0] and "metadata" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.entrypoints.openai.protocol"):
        assert _post(app, "/v1/chat/completions", {"messages": MESSAGES, "user": "u"}).status_code == 200
    assert not [rec for rec in caplog.records if "ignored" in rec.getMessage()]


def test_request_id_names_the_response() -> None:
    app = _app(StubEngine())
    assert _post(app, "/v1/chat/completions", {"messages": MESSAGES, "request_id": "abc"}).json()["id"] == \
        "chatcmpl-abc"
    assert _post(app, "/v1/completions", {"prompt": "hi", "request_id": "abc"}).json()["id"] == "cmpl-abc"


def test_continue_final_message_and_add_special_tokens() -> None:
    engine = StubEngine(text="done")
    app = _app(engine)
    messages = [*MESSAGES, {"role": "assistant", "content": "It is"}]
    r = _post(app, "/v1/chat/completions", {"messages": messages, "add_generation_prompt": False,
                                            "continue_final_message": True})
    assert r.status_code == 200
    rendered = engine.tokenizer.decode(engine.added[-1][0], skip_special_tokens=False)
    # the final message is left open: no end-of-message tag after its content
    assert rendered.endswith("<|im_start|>assistantIt is") and "It is<|im_end|>" not in rendered
    both = _post(app, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    assert "Cannot set both" in both.json()["error"]["message"]


def test_no_tool_calls_key_without_calls() -> None:
    """vLLM leaves `tool_calls` out of a message (and a streamed delta) that has none."""
    app = _app(StubEngine(text="plain text"))
    body = _post(app, "/v1/chat/completions", {"messages": MESSAGES}).json()
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "plain text"}

    async def main() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            r = await http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True})
            return [line for line in r.text.splitlines() if line.startswith("data: {")]
    events = [json.loads(line[6:]) for line in asyncio.run(main())]
    assert events and all("tool_calls" not in c["delta"] for e in events for c in e["choices"])


def test_assistant_tool_call_arguments_reach_the_template_as_dicts() -> None:
    """vLLM parses an assistant message's JSON-string arguments, so that `| tojson` templates write them once."""
    template = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}="
                "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}")
    engine = StubEngine(text="ok")
    app = build_app(engine, chat_template=template)
    messages = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "c2", "type": "function", "function": {"name": "noop", "arguments": ""}}]}]
    assert _post(app, "/v1/chat/completions", {"messages": messages}).status_code == 200
    rendered = engine.tokenizer.decode(engine.added[-1][0], skip_special_tokens=False)
    assert rendered == 'get_weather={"city": "Oslo"};noop={};'
    bad = [MESSAGES[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                              "function": {"name": "f", "arguments": "{oops"}}]}]
    r = _post(app, "/v1/chat/completions", {"messages": bad})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
