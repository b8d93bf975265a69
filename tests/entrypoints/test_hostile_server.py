"""Bad and hostile requests against a real `vllm serve` (tiny model, CPU, --max-model-len 2048, masks on, the admin
endpoints mounted with VLLM_SERVER_DEV_MODE=1, --trust-request-chat-template so that request templates reach the
sandbox): every one of the corpus is a 4xx with an OpenAI error body, none hangs (each within a bounded timeout),
the server serves afterwards and its RSS stays within 10% of where it started; while hostile requests run,
/health answers within 1 s and a normal stream keeps receiving tokens. The limits' messages are checked against
hand-worked numbers (the tiny model: 4096 ids, the longest spans 93 characters, so 2048 x 93 = 190464 characters).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.entrypoints.conftest import API_KEY, RemoteServer, start_server, stop_server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"
MAX_MODEL_LEN = 2048
MAX_TOKEN_CHARS = 93  # the tiny model's longest vocabulary entry
BODY_LIMIT = 1024 * 1024
OK: dict[str, Any] = {"top_k": 5, "max_tokens": 2}
MSG = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--return-sampling-mask", "--logprobs-mode", "processed_logprobs", "--max-model-len",
                        str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--api-key", API_KEY, "--seed", "0",
                        "--max-request-body-bytes", str(BODY_LIMIT), "--trust-request-chat-template"],
                       {"VLLM_SERVER_DEV_MODE": "1"})
    yield srv
    stop_server(srv)


def _wrong_types() -> list[Any]:
    return ["x", 1.5, -1, True, None, [], {}, [1, "a"], {"a": 1}]


def corpus() -> list[tuple[str, str, Any, dict[str, str] | None]]:
    """(method, path, body as a dict / raw text / bytes, extra headers or None)."""
    items: list[tuple[str, str, Any, dict[str, str] | None]] = []
    bases = {COMPLETIONS: {"prompt": "hi", **OK}, CHAT: {"messages": MSG, **OK},
             GENERATE: {"token_ids": [1, 2], "sampling_params": OK}}
    # Not JSON, or not a JSON object, or nested past any parser's depth.
    for path in bases:
        for raw in ["", "{", "}", "[]", "null", "1", '"x"', "{'prompt': 'hi'}", '{"prompt": }', '{"a": 1} trailing',
                    "[" * 100_000, '{"a":' * 50_000, b"\xff\xfe\x00\x01", "\x00" * 64, '{"prompt": "hi",}']:
            items.append(("POST", path, raw, None))
    # Every field with values of the wrong type (strict booleans and numbers; lists and dicts where scalars go).
    cmpl_fields = ["prompt", "max_tokens", "temperature", "top_p", "n", "seed", "stop", "top_k", "min_p", "logprobs",
                   "echo", "stream", "stop_token_ids", "ignore_eos", "min_tokens", "user", "model",
                   "return_token_ids", "stream_options"]
    for field in cmpl_fields:
        for value in _wrong_types():
            body = {**bases[COMPLETIONS], field: value}
            if _accepted(COMPLETIONS, field, value):
                continue
            items.append(("POST", COMPLETIONS, body, None))
    for field in ["messages", "logprobs", "top_logprobs", "max_completion_tokens", "add_generation_prompt",
                  "chat_template_kwargs", "n", "stream"]:
        for value in _wrong_types():
            if _accepted(CHAT, field, value):
                continue
            items.append(("POST", CHAT, {**bases[CHAT], field: value}, None))
    for field in ["token_ids", "sampling_params", "request_id", "stream"]:
        for value in _wrong_types():
            if _accepted(GENERATE, field, value):
                continue
            items.append(("POST", GENERATE, {**bases[GENERATE], field: value}, None))
    for field, value in [("temperature", -1), ("top_k", "5"), ("n", 0), ("max_tokens", 0), ("seed", 2**64),
                         ("output_kind", 1), ("not_a_field", 1), ("stop_token_ids", [-1]), ("logprobs", 10**6)]:
        items.append(("POST", GENERATE, {"token_ids": [1], "sampling_params": {**OK, field: value}}, None))
    # Messages that no template should see.
    for messages in [[{"content": "hi"}], [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 5}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], ["hi"], [None], [[]]]:
        items.append(("POST", CHAT, {**bases[CHAT], "messages": messages}, None))
    # Hostile sizes: bodies over the limit (declared or chunked), prompts too long to tokenize, huge n.
    big = "a " * (BODY_LIMIT // 2 + 10)
    for path, body in [(COMPLETIONS, {"prompt": big, **OK}), (CHAT, {"messages": [{"role": "user", "content": big}]}),
                       (GENERATE, {"token_ids": [1] * (BODY_LIMIT // 2), "sampling_params": OK})]:
        items.append(("POST", path, body, None))
        items.append(("POST", path, _chunked(json.dumps(body).encode()), None))
    long_text = "ab " * 70_000  # 210000 characters > 190464: refused without tokenizing
    items += [("POST", COMPLETIONS, {"prompt": long_text, **OK}, None),
              ("POST", COMPLETIONS, {"prompt": ["hi", long_text], **OK}, None),
              ("POST", CHAT, {"messages": [{"role": "user", "content": long_text}], **OK}, None),
              ("POST", COMPLETIONS, {"prompt": "ab " * 20_000, **OK}, None),  # tokenized off the loop: too long
              ("POST", GENERATE, {"token_ids": [1] * 5000, "sampling_params": OK}, None)]
    for n in [10**30, 2**63, 16385, -5]:
        items.append(("POST", COMPLETIONS, {**bases[COMPLETIONS], "n": n}, None))
        items.append(("POST", CHAT, {**bases[CHAT], "n": n}, None))
        items.append(("POST", GENERATE, {"token_ids": [1], "sampling_params": {**OK, "n": n}}, None))
    items.append(("POST", COMPLETIONS, {"prompt": ["a"] * 100, "n": 200, **OK}, None))
    # Hostile chat templates: unbounded loops, memory bombs, broken Jinja, reserved kwargs.
    for template in [NESTED_LOOPS, "{{ 'a' * 10**10 }}", "{{ 10 ** (10 ** 10) }}", "{{ 'x'|center(10**9) }}",
                     "{{ '%0999999999d'|format(1) }}", "{{ '{:>999999999}'.format(1) }}",
                     "{% macro f(s, n) %}{% if n %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 40) }}",
                     "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                     "{% endfor %}", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                     "{% for i in range(100000) %}{{ 'x' * 100 }}{% endfor %}", "{{ ''.__class__.__mro__ }}",
                     "{{ messages.__class__.__subclasses__() }}", "{{ range.__globals__ }}", "{% for %}",
                     "{{ raise_exception('no') }}", "{% set s = 'a' * 3000 %}{{ s|replace('', s) }}",
                     "{{ (range(100000)|list * 50)|join }}", "{{ 'a'.ljust(10**9) }}", "{{ cycler }}{{ 1/0 }}",
                     "{{ messages.append(1) }}", "", "{{ eos_token }}" * 3000, "{{ eos_token }}" * 5000]:
        items.append(("POST", CHAT, {**bases[CHAT], "chat_template": template}, None))
    for key in ["messages", "tokenize", "chat_template", "add_generation_prompt", "max_steps", "timeout_s"]:
        items.append(("POST", CHAT, {**bases[CHAT], "chat_template_kwargs": {key: None}}, None))
    # Auth, unknown model, wrong method, unknown path.
    for path in bases:
        items.append(("POST", path, bases[path], {"Authorization": "Bearer wrong"}))
        items.append(("POST", path, bases[path], {"Authorization": ""}))
        items.append(("POST", path, {**bases[path], "model": "no-such-model"}, None))
        items.append(("GET", path, None, None))
        items.append(("PUT", path, bases[path], None))
    items.append(("POST", "/v1/nothing", {}, None))
    # The admin endpoints (VLLM_SERVER_DEV_MODE=1): bad bodies and query parameters, none with an effect.
    for path, raw in [("/pause?mode=bogus", ""), ("/pause?clear_cache=maybe", ""), ("/abort_requests", "[1]"),
                      ("/abort_requests", '{"request_ids": "x"}'), ("/abort_requests", '{"request_ids": [1, 2]}'),
                      ("/collective_rpc", ""), ("/collective_rpc", "{"), ("/collective_rpc", '{"method": 5}'),
                      ("/collective_rpc", '{"method": "x", "args": 5}'),
                      ("/collective_rpc", '{"method": "x", "timeout": -1}'),
                      ("/collective_rpc", '{"method": "x", "kwargs": []}'),
                      ("/collective_rpc", '{"method": "execute_model"}'),
                      ("/update_weights", "{}"), ("/update_weights", '{"weight_dir": 5}'),
                      ("/update_weights", '{"weight_dir": "/nonexistent-dir"}'),
                      ("/init_weight_transfer_engine", "[]"), ("/init_weight_transfer_engine", '{"init_info": 5}'),
                      ("/update_weight_version", '{"new_version": [1]}'), ("/update_weight_version", "null"),
                      ("/init_broadcaster", "{}"), ("/sleep", "{}"), ("/sleep?level=7", "{}"),
                      ("/wake_up?tags=bogus", "{}"),
                      ("/collective_rpc", "[" * 100_000), ("/update_weights", b"\xff\xff")]:
        items.append(("POST", path, raw, None))
    items.append(("POST", "/collective_rpc", "x" * (BODY_LIMIT + 1), None))
    return items


def _accepted(path: str, field: str, value: Any) -> bool:
    """Values of the wrong-type sweep that are in fact valid for the field (they would be served, not refused)."""
    valid = {
        "prompt": lambda v: isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(p, str) for p in v)),
        "stop": lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(p, str)
                                                                                        for p in v)),
        "user": lambda v: v is None or isinstance(v, str),
        "model": lambda v: v is None,
        "stream_options": lambda v: v is None or v == {} or v == {"a": 1},
        "chat_template_kwargs": lambda v: v is None or v == {} or v == {"a": 1},
        "sampling_params": lambda v: v == {} or v is None,
        "stop_token_ids": lambda v: v is None or v == [],
        "request_id": lambda v: isinstance(v, str) and v != "",
        "logprobs": lambda v: v is None or (path == CHAT and isinstance(v, bool)),
        "top_logprobs": lambda v: v is None,
        "echo": lambda v: isinstance(v, bool), "stream": lambda v: isinstance(v, bool),
        "ignore_eos": lambda v: isinstance(v, bool), "return_token_ids": lambda v: isinstance(v, bool),
        "add_generation_prompt": lambda v: isinstance(v, bool),
        "seed": lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)),
        "max_tokens": lambda v: v is None, "max_completion_tokens": lambda v: v is None,
        "temperature": lambda v: v is None or v == 1.5, "top_p": lambda v: v is None, "min_p": lambda v: v is None,
        "top_k": lambda v: v is None or v == -1, "min_tokens": lambda v: False,
    }
    check = valid.get(field)
    return bool(check(value)) if check is not None else False


def _chunked(data: bytes) -> Iterator[bytes]:
    for i in range(0, len(data), 64 * 1024):
        yield data[i:i + 64 * 1024]


def _send(http: httpx.Client, method: str, path: str, body: Any, headers: dict[str, str] | None) -> httpx.Response:
    if body is None or isinstance(body, (str, bytes)) or hasattr(body, "__next__"):
        content = body
    else:
        content = json.dumps(body)
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    return http.request(method, path, content=content, headers=all_headers)


def check_openai_error(resp: httpx.Response, context: Any) -> dict[str, Any]:
    assert 400 <= resp.status_code < 500, (context, resp.status_code, resp.text[:500])
    assert resp.headers["content-type"].startswith("application/json"), (context, resp.headers)
    body = resp.json()
    assert set(body) == {"error"}, (context, body)
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, (context, error)
    assert error["code"] == resp.status_code and isinstance(error["message"], str) and error["message"], context
    return error


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _serve_one(http: httpx.Client) -> None:
    resp = http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 3, "top_k": 5, "return_token_ids": True})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and all(t in m for t, m in zip(choice["token_ids"], choice["sampling_mask"]))


def test_hostile_corpus_is_4xx_with_openai_body(server: RemoteServer) -> None:
    items = corpus()
    assert len(items) >= 250
    paths = {path.split("?")[0] for _, path, _, _ in items}
    assert {COMPLETIONS, CHAT, GENERATE, "/pause", "/collective_rpc", "/update_weights"} <= paths
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=httpx.Timeout(30.0)) as http:
        for _ in range(3):  # warm up: the first requests allocate what the server keeps
            _serve_one(http)
        _send(http, "POST", CHAT, {"messages": MSG, **OK, "chat_template": NESTED_LOOPS}, None)
        rss_before = rss_kib(server.proc.pid)
        statuses: dict[int, int] = {}
        for method, path, body, headers in items:
            started = time.monotonic()
            resp = _send(http, method, path, body, headers)
            assert time.monotonic() - started < 30
            check_openai_error(resp, (method, path, str(body)[:200]))
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        assert not [s for s in statuses if s >= 500], statuses
        assert {400, 401, 404, 405, 413} <= set(statuses), statuses
        assert http.get("/health").status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": False}
        _serve_one(http)
        rss_after = rss_kib(server.proc.pid)
    assert rss_after <= rss_before * 1.10, (rss_before, rss_after)


def test_limit_messages(server: RemoteServer) -> None:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as http:
        too_large = _send(http, "POST", COMPLETIONS, "x" * (BODY_LIMIT + 1), None)
        error = check_openai_error(too_large, "413")
        assert error["code"] == 413 and error["type"] == "RequestEntityTooLargeError"
        assert too_large.headers["connection"] == "close"  # the rest of the body is not read
        assert f"({BODY_LIMIT + 1} bytes) is larger than this server's limit of {BODY_LIMIT} bytes" in error["message"]
        chunked = check_openai_error(_send(http, "POST", COMPLETIONS, _chunked(b"x" * (BODY_LIMIT + 1)), None), "chunk")
        assert chunked["code"] == 413
        # Exactly at the limit the body is read (and refused for what it says, not its size).
        assert check_openai_error(_send(http, "POST", COMPLETIONS, "x" * BODY_LIMIT, None), "at")["code"] == 400
        limit = MAX_MODEL_LEN * MAX_TOKEN_CHARS
        error = check_openai_error(_send(http, "POST", COMPLETIONS, {"prompt": "a" * (limit + 1), **OK}, None), "chars")
        assert error["param"] == "prompt"
        assert error["message"].startswith(f"The prompt has {limit + 1} characters, more than fit this model's "
                                           f"maximum context length of {MAX_MODEL_LEN} tokens")
        # Just under the character bound the text is tokenized (off the event loop) and refused by its tokens.
        error = check_openai_error(_send(http, "POST", COMPLETIONS, {"prompt": "ab " * 60_000, **OK}, None), "toks")
        assert "maximum context length is 2048 tokens" in error["message"] or "longer than the maximum model length" \
            in error["message"]
        error = check_openai_error(_send(http, "POST", CHAT, {"messages": MSG, **OK, "chat_template": NESTED_LOOPS},
                                         None), "loops")
        assert error["param"] == "chat_template" and "steps" in error["message"]


def test_request_template_renders_as_the_servers_own(server: RemoteServer) -> None:
    """The model's own template sent in the request (the sandbox's step budget, compiled for the request) gives the
    same prompt tokens as the server's cached path; a variant of it renders what it says."""
    from vllm.transformers_utils.tokenizer import get_tokenizer

    own_template = get_tokenizer(server.model).chat_template
    assert isinstance(own_template, str)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
        body = {"messages": messages, **OK, "return_token_ids": True}
        own = http.post(CHAT, json=body)
        sent = http.post(CHAT, json={**body, "chat_template": own_template})
        assert own.status_code == 200 and sent.status_code == 200, sent.text
        assert sent.json()["prompt_token_ids"] == own.json()["prompt_token_ids"]
        plain = http.post(CHAT, json={**body, "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})
        completion = http.post(COMPLETIONS, json={"prompt": "Be brief.hihellomore", **OK, "return_token_ids": True})
        # NOTE: the completion's prompt gets the BOS the tokenizer adds; a chat template writes its own.
        assert plain.json()["prompt_token_ids"] == completion.json()["choices"][0]["prompt_token_ids"][-len(
            plain.json()["prompt_token_ids"]):]


def test_health_and_streams_go_on_during_hostile_requests(server: RemoteServer) -> None:
    stream_times: list[float] = []
    stream_done = threading.Event()
    stop = threading.Event()

    def stream() -> None:
        body = {"prompt": "hi", "top_k": 5, "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as http:
            with http.stream("POST", COMPLETIONS, json=body) as resp:
                assert resp.status_code == 200
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        stream_times.append(time.monotonic())
        stream_done.set()

    hostile_bodies = [
        (CHAT, {"messages": MSG, **OK, "chat_template": NESTED_LOOPS}),
        (COMPLETIONS, {"prompt": "ab " * 60_000, **OK}),  # ~180000 characters, tokenized in the pool
        (CHAT, {"messages": [{"role": "user", "content": "ab " * 60_000}], **OK}),
        (COMPLETIONS, {"prompt": "hi", **OK, "n": 10**30}),
        (COMPLETIONS, {"prompt": "a " * (BODY_LIMIT // 2 + 10), **OK}),
    ]
    hostile_statuses: list[int] = []

    def hostile() -> None:
        with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as http:
            while not stop.is_set():
                for path, body in hostile_bodies:
                    hostile_statuses.append(http.post(path, json=body).status_code)

    streamer = threading.Thread(target=stream)
    attackers = [threading.Thread(target=hostile) for _ in range(3)]
    streamer.start()
    deadline = time.monotonic() + 60
    while not stream_times and time.monotonic() < deadline:
        time.sleep(0.01)
    for t in attackers:
        t.start()
    health_s: list[float] = []
    window_start = time.monotonic()
    with httpx.Client(base_url=server.url, timeout=10) as http:
        while time.monotonic() - window_start < 6 and not stream_done.is_set():
            started = time.monotonic()
            assert http.get("/health").status_code == 200
            health_s.append(time.monotonic() - started)
            time.sleep(0.05)
    window_end = time.monotonic()
    stop.set()
    for t in attackers:
        t.join(120)
    streamer.join(120)
    assert hostile_statuses and all(400 <= s < 500 for s in hostile_statuses), hostile_statuses
    assert len(health_s) >= 5 and max(health_s) < 1.0, health_s
    in_window = [t for t in stream_times if window_start <= t <= window_end]
    assert len(in_window) >= 3, (len(stream_times), len(in_window))
    gaps = [b - a for a, b in zip(stream_times, stream_times[1:])]
    assert max(gaps) < 2.0, max(gaps)
