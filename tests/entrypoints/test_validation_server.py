"""Request validation through a real `vllm serve` (see conftest.py; --max-model-len 2048, masks on, tiny model with
a 4096-id vocabulary): every bad body of the corpus below, across /v1/completions, /v1/chat/completions and
/inference/v1/generate, is a 400 with an OpenAI error body whose `param` names the field (never a 5xx, never a
request added to the engine), and the server serves a normal request afterwards. Hand-worked cases check the
messages: vLLM's max_tokens text with both numbers, the n bound, seed + n.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import RemoteServer

MAX_MODEL_LEN = 2048
VOCAB_SIZE = 4096
INT64_MAX = 2**63 - 1
OK: dict[str, Any] = {"top_k": 5, "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"


def cmpl(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", **OK, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": MSG, **OK, **fields}


def gen(token_ids: Any = (1, 2), **sampling: Any) -> dict[str, Any]:
    return {"token_ids": list(token_ids) if isinstance(token_ids, tuple) else token_ids,
            "sampling_params": {**OK, **sampling}}


# (path, body as a dict or raw JSON text, the `param` the error must name; None: not checked)
CORPUS: list[tuple[str, Any, str | None]] = [
    # Non-finite and absurd sampling values (JSON's NaN / Infinity literals, 1e400 parses as inf).
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "temperature": NaN}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "temperature": Infinity}', "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "temperature": 1e400}', "temperature"),
    (COMPLETIONS, cmpl(temperature=1e39), "temperature"),
    (COMPLETIONS, cmpl(temperature=2**64), "temperature"),
    (COMPLETIONS, cmpl(temperature=2.5), "temperature"),
    (COMPLETIONS, cmpl(temperature=-1), "temperature"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "top_p": NaN}', "top_p"),
    (COMPLETIONS, cmpl(top_p=0), "top_p"),
    (COMPLETIONS, cmpl(top_p=1.5), "top_p"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "min_p": -Infinity}', "min_p"),
    (COMPLETIONS, cmpl(min_p=2), "min_p"),
    (COMPLETIONS, cmpl(top_k=-3), "top_k"),
    (COMPLETIONS, cmpl(top_k=2**63), "top_k"),
    (COMPLETIONS, cmpl(top_k=2**64), "top_k"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "presence_penalty": NaN}', "presence_penalty"),
    (COMPLETIONS, cmpl(frequency_penalty=3), "frequency_penalty"),
    (COMPLETIONS, cmpl(repetition_penalty=1e30), "repetition_penalty"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "temperature": Infinity}', "temperature"),
    (CHAT, chat(top_p=-0.5), "top_p"),
    (GENERATE, '{"token_ids": [1, 2], "sampling_params": {"top_k": 5, "temperature": NaN}}',
     "sampling_params.temperature"),
    (GENERATE, gen(temperature=1e39), "sampling_params.temperature"),
    (GENERATE, gen(min_p=1.5), "sampling_params.min_p"),
    # Integers beyond int64 / uint64, and seed + n.
    (COMPLETIONS, cmpl(seed=2**63), "seed"),
    (COMPLETIONS, cmpl(seed=2**64), "seed"),
    (COMPLETIONS, cmpl(seed=-(2**63) - 1), "seed"),
    (COMPLETIONS, cmpl(seed=INT64_MAX, n=2), "seed"),
    (COMPLETIONS, cmpl(stop_token_ids=[2**64]), "stop_token_ids"),
    (COMPLETIONS, cmpl(stop_token_ids=[-1]), "stop_token_ids"),
    (COMPLETIONS, cmpl(max_tokens=2**64), "max_tokens"),
    (COMPLETIONS, cmpl(max_tokens=10**30), "max_tokens"),
    (COMPLETIONS, cmpl(logprobs=2**64), "logprobs"),
    (COMPLETIONS, cmpl(min_tokens=2**64), "min_tokens"),
    (COMPLETIONS, {"prompt": [2**64], "top_k": 5}, "prompt_token_ids"),
    (COMPLETIONS, {"prompt": [VOCAB_SIZE], "top_k": 5}, "prompt_token_ids"),
    (COMPLETIONS, {"prompt": [[-1], [1, 2]], "top_k": 5}, "prompt_token_ids"),
    (CHAT, chat(seed=2**64), "seed"),
    (CHAT, chat(max_completion_tokens=2**64), "max_tokens"),
    (CHAT, chat(logprobs=True, top_logprobs=2**64), "logprobs"),
    (GENERATE, gen(seed=2**64), "sampling_params.seed"),
    (GENERATE, gen(seed=INT64_MAX, n=3), "sampling_params.seed"),
    (GENERATE, gen(top_k=2**64), "sampling_params.top_k"),
    (GENERATE, gen(stop_token_ids=[2**64]), "sampling_params.stop_token_ids"),
    (GENERATE, gen(max_tokens=2**64), "sampling_params.max_tokens"),
    (GENERATE, gen(token_ids=[2**64]), "prompt_token_ids"),
    (GENERATE, gen(token_ids=[VOCAB_SIZE]), "prompt_token_ids"),
    (GENERATE, gen(token_ids=[-5]), "prompt_token_ids"),
    # n, bounded before any work.
    (COMPLETIONS, cmpl(n=10**30), "n"),
    (COMPLETIONS, cmpl(n=16385), "n"),
    (COMPLETIONS, cmpl(n=0), "n"),
    (COMPLETIONS, {"prompt": ["a"] * 3, "n": 6000, **OK}, "n"),
    (CHAT, chat(n=10**30), "n"),
    (GENERATE, gen(n=10**30), "sampling_params.n"),
    (GENERATE, gen(n=-1), "sampling_params.n"),
    # max_tokens over the context the prompt leaves.
    (COMPLETIONS, cmpl(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (CHAT, chat(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (CHAT, chat(max_completion_tokens=MAX_MODEL_LEN), "max_tokens"),
    (GENERATE, gen(max_tokens=MAX_MODEL_LEN - 1), "sampling_params.max_tokens"),
    # Lone surrogates (JSON's "\ud800" escape) wherever a string goes to the tokenizer or the wire.
    (COMPLETIONS, '{"prompt": "hi \\ud800", "top_k": 5}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "\\udfff"], "top_k": 5}', "prompt"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "stop": "\\ud800"}', "stop"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "stop": ["x", "a\\udc00b"]}', "stop"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "user": "\\ud800"}', "user"),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}], "top_k": 5}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}], "top_k": 5}',
     "messages[0].content[0].text"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi", "name": "\\ud800"}], "top_k": 5}',
     "messages[0].name"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "stop": "\\ud800"}', "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "chat_template_kwargs": {"x": "\\ud800"}}',
     "chat_template_kwargs.x"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "top_k": 5, "chat_template": "\\ud800"}',
     "chat_template"),
    (GENERATE, '{"token_ids": [1], "request_id": "\\ud800", "sampling_params": {"top_k": 5}}', "request_id"),
    (GENERATE, '{"token_ids": [1], "sampling_params": {"top_k": 5, "stop": ["\\ud800"]}}', "sampling_params.stop"),
    (COMPLETIONS, '{"prompt": "hi", "top_k": 5, "model": "\\ud800"}', "model"),
    # Strict booleans and token ids.
    (COMPLETIONS, cmpl(stream="yes"), "stream"),
    (COMPLETIONS, cmpl(stream=1), "stream"),
    (COMPLETIONS, cmpl(echo="true"), "echo"),
    (COMPLETIONS, cmpl(ignore_eos="no"), "ignore_eos"),
    (COMPLETIONS, cmpl(return_token_ids=0), "return_token_ids"),
    (COMPLETIONS, cmpl(return_sampling_mask="false"), "return_sampling_mask"),
    (COMPLETIONS, cmpl(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (COMPLETIONS, {"prompt": [True, False], "top_k": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, True]], "top_k": 5}, "prompt"),
    (COMPLETIONS, {"prompt": [1.0, 2.0], "top_k": 5}, "prompt"),
    (COMPLETIONS, {"prompt": ["a", [1]], "top_k": 5}, "prompt"),
    (COMPLETIONS, cmpl(stop_token_ids=[True]), "stop_token_ids.0"),
    (COMPLETIONS, cmpl(n=True), "n"),
    (COMPLETIONS, cmpl(top_k=True), "top_k"),
    (COMPLETIONS, cmpl(temperature=True), "temperature"),
    (COMPLETIONS, cmpl(logprobs=True), "logprobs"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(logprobs="yes"), "logprobs"),
    (CHAT, chat(add_generation_prompt="no"), "add_generation_prompt"),
    (CHAT, chat(max_tokens=True), "max_tokens"),
    (GENERATE, {"token_ids": [True, False], "sampling_params": OK}, "token_ids.0"),
    (GENERATE, {"token_ids": [1.5], "sampling_params": OK}, "token_ids.0"),
    (GENERATE, {"token_ids": ["1"], "sampling_params": OK}, "token_ids.0"),
    (GENERATE, {**gen(), "stream": "yes"}, "stream"),
    (GENERATE, gen(ignore_eos="yes"), "sampling_params.ignore_eos"),
    (GENERATE, gen(top_k=True), "sampling_params.top_k"),
    (GENERATE, gen(stop_token_ids=[True]), "sampling_params.stop_token_ids"),
    (GENERATE, gen(return_sampling_mask=1), "sampling_params.return_sampling_mask"),
    # vLLM fields not implemented: named, never dropped.
    (GENERATE, gen(best_of=3), "sampling_params.best_of"),
    (GENERATE, gen(logit_bias={"5": "x"}), "sampling_params.logit_bias"),
    (GENERATE, gen(logit_bias={"9999999": 1.0}), "logit_bias"),
    (GENERATE, gen(allowed_token_ids=[]), "sampling_params.allowed_token_ids"),
    (GENERATE, gen(allowed_token_ids=[9999999]), "allowed_token_ids"),
    (COMPLETIONS, cmpl(logit_bias={"9999999": 1.0}), "logit_bias"),
    (CHAT, chat(allowed_token_ids=[-1]), None),
    (GENERATE, gen(logits_processors=["x"]), "sampling_params.logits_processors"),
    (GENERATE, {"token_ids": [1], "request_id": "", "sampling_params": OK}, "request_id"),
]


def check_error(resp: httpx.Response, param: str | None, context: Any) -> dict[str, Any]:
    assert resp.status_code == 400, (context, resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json"), (context, resp.headers)
    body = resp.json()
    assert set(body) == {"error"}, (context, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, (context, error)
    assert error["code"] == 400 and error["type"] == "BadRequestError", (context, error)
    assert isinstance(error["message"], str) and error["message"], (context, error)
    if param is not None:
        assert error["param"] == param, (context, error)
    return error


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return http.post(path, content=content, headers={"Content-Type": "application/json"})


def num_requests(http: httpx.Client) -> float:
    """Requests the server counted as finished (any reason): a refused request was never added, so never counted."""
    text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def test_bad_request_corpus_is_400_with_openai_body(server: RemoteServer) -> None:
    assert len(CORPUS) >= 60
    assert {path for path, _, _ in CORPUS} == {COMPLETIONS, CHAT, GENERATE}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        before = num_requests(http)
        statuses = []
        for path, body, param in CORPUS:
            resp = post(http, path, body)
            statuses.append(resp.status_code)
            check_error(resp, param, (path, body))
        assert not [s for s in statuses if s >= 500]
        assert num_requests(http) == before  # nothing refused reached the engine
        assert http.get("/health").status_code == 200
        resp = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "top_k": 5, "return_token_ids": True})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert len(choice["token_ids"]) == 3 and all(t in m for t, m in zip(choice["token_ids"],
                                                                             choice["sampling_mask"]))


def test_max_tokens_over_the_context_left_names_both_numbers(server: RemoteServer) -> None:
    """vLLM's message, which clients parse: "'max_tokens' or 'max_completion_tokens' is too large: M. This model's
    maximum context length is L tokens and your request has P input tokens (M > L - P)."; exactly the room fits."""
    # A prompt that leaves room for 3 tokens: 3 are served, 4 are refused (a short run on CPU).
    prompt_ids = [1] * (MAX_MODEL_LEN - 3)
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
        for path, body in ((GENERATE, {"token_ids": prompt_ids, "sampling_params": {"top_k": 5}}),
                           (COMPLETIONS, {"prompt": prompt_ids, "top_k": 5})):
            sp = body["sampling_params"] if path == GENERATE else body
            sp["max_tokens"] = 4
            error = check_error(post(http, path, body), None, path)
            assert error["param"] == ("sampling_params.max_tokens" if path == GENERATE else "max_tokens")
            assert error["message"].startswith(
                f"'max_tokens' or 'max_completion_tokens' is too large: 4. This model's maximum context length is "
                f"{MAX_MODEL_LEN} tokens and your request has {MAX_MODEL_LEN - 3} input tokens "
                f"(4 > {MAX_MODEL_LEN} - {MAX_MODEL_LEN - 3}).")
            sp.update(max_tokens=3, ignore_eos=True)
            resp = post(http, path, body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 3
        # A text prompt is counted in tokens, as the engine tokenizes it (the tiny model's BOS included).
        error = check_error(post(http, COMPLETIONS, {"prompt": "hello world", "top_k": 5, "max_tokens": 2043}),
                            "max_tokens", "text")
        assert "your request has 6 input tokens (2043 > 2048 - 6)" in error["message"]
        assert post(http, COMPLETIONS, {"prompt": "hello world", "top_k": 5, "max_tokens": 2}).status_code == 200
        # Chat counts the rendered template's tokens.
        error = check_error(post(http, CHAT, {"messages": MSG, "top_k": 5, "max_tokens": 5000}), "max_tokens", "chat")
        assert "is too large: 5000." in error["message"] and "(5000 > 2048 - " in error["message"]


def test_n_bound_and_seed_overflow_messages(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        error = check_error(post(http, COMPLETIONS, cmpl(n=10**30)), "n", "n")
        assert "n must be an integer in [1, 16384] (VLLM_MAX_N_SEQUENCES)" in error["message"]
        error = check_error(post(http, COMPLETIONS, {"prompt": ["a"] * 3, "n": 6000, **OK}), "n", "n x prompts")
        assert "n x the number of prompts must be at most 16384" in error["message"]
        error = check_error(post(http, GENERATE, gen(seed=INT64_MAX - 1, n=3)), "sampling_params.seed", "seed")
        assert f"seed={INT64_MAX - 1}, n=3" in error["message"]
        # The largest seed that fits, with n samples: accepted (sample j seeded with seed + j).
        resp = post(http, GENERATE, gen(seed=INT64_MAX - 2, n=3))
        assert resp.status_code == 200, resp.text
        assert sorted(c["index"] for c in resp.json()["choices"]) == [0, 1, 2]


@pytest.mark.parametrize("path, body", [
    (COMPLETIONS, cmpl(stream=False, echo=False, ignore_eos=True, return_token_ids=True, stop_token_ids=[7])),
    (COMPLETIONS, {"prompt": [[1, 2, 3]], "top_k": 5, "max_tokens": 2, "seed": -(2**63), "temperature": 2}),
    (CHAT, chat(logprobs=True, top_logprobs=2, stream=False, add_generation_prompt=True)),
    (GENERATE, {**gen(token_ids=(1, 2), seed=INT64_MAX, stop_token_ids=[VOCAB_SIZE - 1]), "stream": False}),
])
def test_valid_boundaries_still_served(server: RemoteServer, path: str, body: dict[str, Any]) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        resp = post(http, path, body)
        assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, GENERATE])
def test_token_fields_reach_the_sampler(server: RemoteServer, path: str) -> None:
    """allowed_token_ids, logit_bias, penalties, bad_words and min_tokens are applied, not dropped: every token
    and every mask entry is an allowed id (top_k 3 of the 4), and the +100 bias makes token 300 the one drawn."""
    allowed = [300, 301, 302, 303]
    fields = dict(allowed_token_ids=allowed, logit_bias={"300": 100}, presence_penalty=0.5, frequency_penalty=0.1,
                  repetition_penalty=1.1, bad_words=["zzz"], min_tokens=2, max_tokens=4, temperature=1.0,
                  top_k=3, ignore_eos=True, return_token_ids=True)
    body = gen(**fields) if path == GENERATE else (cmpl(**fields) if path == COMPLETIONS else chat(**fields))
    if path == GENERATE:
        body["sampling_params"].pop("return_token_ids")
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        resp = post(http, path, body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == [300] * 4, choice
        assert all(len(m) == 3 and 300 in m and set(m) <= set(allowed) for m in choice["sampling_mask"]), choice
