"""A real `vllm serve` (tiny model, --generation-config pointing at a written generation_config.json, CPU, masks on,
tools on): /tokenize
and /detokenize against the tokenizer read by transformers, the generation config's defaults seen through the
sampling masks and output lengths, and a chat with tools replayed with the openai client."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.entrypoints.conftest import API_KEY, MODEL, RemoteServer, start_server, stop_server

transformers = pytest.importorskip("transformers")
TEMPLATE_FILE = os.path.join(os.path.dirname(__file__), "assets", "hermes_tools.jinja")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
TOP_K, MAX_NEW_TOKENS = 5, 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    folder = tmp_path_factory.mktemp("generation")
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 1, "temperature": 0.5, "top_k": TOP_K, "max_new_tokens": MAX_NEW_TOKENS}))
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len", "512",
                        "--max-num-seqs", "8", "--api-key", API_KEY, "--seed", "0", "--chat-template",
                        TEMPLATE_FILE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                        "--generation-config", str(folder)])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def hf() -> object:
    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"),
                                                bos_token="<s>", eos_token="</s>")


def _post(server: RemoteServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


@pytest.mark.parametrize("prompt", ["Hello world", "  spaces\tand\nnewlines ", "Zürich 東京 🙂", "</s><s>"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_prompt_matches_transformers(server: RemoteServer, hf: object, prompt: str,
                                              add_special_tokens: bool) -> None:
    r = _post(server, "/tokenize", {"model": server.model, "prompt": prompt, "add_special_tokens": add_special_tokens,
                                    "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = hf.encode(prompt, add_special_tokens=False)
    if add_special_tokens:  # tokenizer_config.json: add_bos_token true, and tokenizer.json adds none itself
        expected = [hf.convert_tokens_to_ids("<s>"), *expected]
    assert body["tokens"] == expected and body["count"] == len(expected) and body["max_model_len"] == 512
    assert body["token_strs"] == hf.convert_ids_to_tokens(expected)
    plain = _post(server, "/tokenize", {"prompt": prompt}).json()
    assert plain["token_strs"] is None and plain["tokens"][0] == hf.convert_tokens_to_ids("<s>")


def test_tokenize_messages_with_tools_matches_the_chat_prompt(server: RemoteServer, hf: object) -> None:
    with open(TEMPLATE_FILE) as f:
        template = f.read()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    r = _post(server, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert r.status_code == 200, r.text
    # NOTE: the server sends each tool with vLLM's fields, and a message without content as "" (its text).
    hf_messages = [dict(m, content=m["content"] or "") for m in messages]
    expected = hf.apply_chat_template(hf_messages, tools=TOOLS, chat_template=template, tokenize=True,
                                      add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert r.json()["tokens"] == expected and r.json()["count"] == len(expected)
    # the chat endpoint builds the same prompt (its prompt_token_ids)
    chat = _post(server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS, "return_token_ids": True,
                                                  "max_tokens": 1}).json()
    assert chat["prompt_token_ids"] == expected
    both = _post(server, "/tokenize", {"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_detokenize_matches_transformers(server: RemoteServer, hf: object) -> None:
    ids = hf.encode("Hello <s> world Zürich", add_special_tokens=False) + [1, 0, 7]
    r = _post(server, "/detokenize", {"model": server.model, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(ids, skip_special_tokens=False)}
    bad = _post(server, "/detokenize", {"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert _post(server, "/detokenize", {"tokens": [1, True]}).status_code == 400


def _client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_generation_config_defaults_apply_to_unset_fields(server: RemoteServer) -> None:
    client = _client(server)
    # max_new_tokens 3 caps a request without max_tokens, and one asking for more; top_k 5 bounds every mask
    for extra in ({}, {"max_tokens": 50}):
        out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Hi"}],
                                             extra_body={"ignore_eos": True}, **extra)
        assert out.usage.completion_tokens == MAX_NEW_TOKENS
        masks = out.choices[0].model_dump()["sampling_mask"]
        assert [len(m) for m in masks] == [TOP_K] * MAX_NEW_TOKENS  # random float logits: no ties at the k-th
    # a field the request sets wins over the default
    own = client.completions.create(model=server.model, prompt="Hi", max_tokens=2,
                                    extra_body={"top_k": 7, "ignore_eos": True})
    assert [len(m) for m in own.choices[0].model_dump()["sampling_mask"]] == [7, 7]
    # the defaults are exactly the request that spells them out (same seed: same tokens and logprobs)
    implicit = client.completions.create(model=server.model, prompt="The", seed=11, logprobs=2,
                                         extra_body={"ignore_eos": True})
    explicit = client.completions.create(model=server.model, prompt="The", seed=11, logprobs=2, max_tokens=3,
                                         temperature=0.5, extra_body={"top_k": TOP_K, "ignore_eos": True})
    hotter = client.completions.create(model=server.model, prompt="The", seed=11, logprobs=2, max_tokens=3,
                                       temperature=1.0, extra_body={"top_k": TOP_K, "ignore_eos": True})
    assert implicit.choices[0].logprobs.token_logprobs == explicit.choices[0].logprobs.token_logprobs
    assert implicit.choices[0].text == explicit.choices[0].text
    assert implicit.choices[0].logprobs.top_logprobs[0] != hotter.choices[0].logprobs.top_logprobs[0]


def test_chat_with_tools_replayed_with_the_openai_client(server: RemoteServer) -> None:
    client = _client(server)
    out = client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "Weather?"}],
                                         tools=TOOLS, max_tokens=3)
    # the tiny model writes no <tool_call>: the text is the content and no call is reported
    choice = out.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    chunks = list(client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "W?"}],
                                                 tools=TOOLS, max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert not any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    with pytest.raises(openai.BadRequestError, match="structured outputs"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "W?"}],
                                       tools=TOOLS, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="response_format is not supported"):
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "W?"}],
                                       response_format={"type": "json_object"})
