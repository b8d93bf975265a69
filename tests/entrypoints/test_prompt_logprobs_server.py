"""prompt_logprobs, echo and return_tokens_as_token_ids through a real `vllm serve` (bundled tiny model, CPU, 16-token
steps so that prompts are chunked), in vLLM's response shapes; prime-rl's scoring calls replayed as its code reads
them; values against a float64 log-softmax of Hugging Face transformers' logits."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from tests.entrypoints.conftest import API_KEY, MODEL, RemoteServer, start_server, stop_server

PROMPT_IDS = [0, 5, 17, 42, 9, 100, 3, 7, 8, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 300, 301, 302, 4000, 77, 91,
              92, 93, 94, 95, 96, 97, 98, 99, 1000, 1001, 2]


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = start_server(["--max-num-batched-tokens", "16", "--max-num-seqs", "8", "--max-model-len", "256",
                        "--api-key", API_KEY, "--return-tokens-as-token-ids"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """[P - 1, V] float64 log-softmax of HF's logits for PROMPT_IDS (rows: prompt tokens 1..P-1)."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT_IDS])).logits[0, :-1].double().log_softmax(-1)


def post(server: RemoteServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=server.headers, timeout=120)


def check_prompt_logprobs(plp: Any, prompt: list[int], ref: torch.Tensor | None, k: int) -> None:
    """vLLM's JSON shape: None first, then {str(id): {logprob, rank, decoded_token}} with the prompt token and k
    top tokens (ranks 1..k)."""
    assert isinstance(plp, list) and len(plp) == len(prompt)
    assert plp[0] is None
    for j in range(1, len(prompt)):
        entry = plp[j]
        assert isinstance(entry, dict) and str(prompt[j]) in entry
        for key, value in entry.items():
            assert set(value) == {"logprob", "rank", "decoded_token"}
            assert isinstance(value["rank"], int) and value["rank"] >= 1
            if ref is not None:
                assert value["logprob"] == pytest.approx(ref[j - 1, int(key)].item(), abs=2e-4)
        ranked = sorted(v["rank"] for t, v in entry.items() if t != str(prompt[j]) or v["rank"] <= k)
        assert ranked == list(range(1, k + 1))


def prime_rl_flatten(response: dict[str, Any], token_ids: list[int]) -> list[float]:
    """How prime-rl's teacher scoring reads /inference/v1/generate's prompt_logprobs: one entry per token, the
    first empty (0.0), each later one looked up by str(token id) then by the int, its "logprob"."""
    prompt_logprobs = response.get("prompt_logprobs") or []
    assert len(prompt_logprobs) == len(token_ids)
    flat = []
    for i, (token_id, entry) in enumerate(zip(token_ids, prompt_logprobs)):
        if not entry:
            assert i == 0
            flat.append(0.0)
            continue
        target = entry.get(str(token_id))
        if target is None:
            target = entry.get(token_id)
        assert target is not None
        flat.append(float(target["logprob"]))
    return flat


def test_prime_rl_generate_call(server: RemoteServer, reference: torch.Tensor) -> None:
    body = {"model": server.model, "token_ids": PROMPT_IDS,
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "top_p": 1.0, "prompt_logprobs": 1}}
    resp = post(server, "/inference/v1/generate", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    check_prompt_logprobs(data["prompt_logprobs"], PROMPT_IDS, reference, 1)
    flat = prime_rl_flatten(data, PROMPT_IDS)
    expected = [0.0] + [reference[j - 1, PROMPT_IDS[j]].item() for j in range(1, len(PROMPT_IDS))]
    assert flat == pytest.approx(expected, abs=2e-4)
    assert len(data["choices"][0]["token_ids"]) == 1
    # The call as written ({"max_tokens": 1, "prompt_logprobs": 1}), streamed: once, in a chunk.
    body = {"token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 1}, "stream": True}
    resp = post(server, "/inference/v1/generate", body)
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.split("\n\n") if line.startswith("data: {")]
    carried = [e["prompt_logprobs"] for e in events if e.get("prompt_logprobs") is not None]
    assert len(carried) == 1 and carried[0] == data["prompt_logprobs"]


def test_completion_scoring_call(server: RemoteServer, reference: torch.Tensor) -> None:
    """The prompt-scoring call of RL and eval code: max_tokens 1, temperature 0, prompt_logprobs 1, token ids."""
    body = {"model": server.model, "prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 1, "prompt_logprobs": 1,
            "return_token_ids": True}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT_IDS
    check_prompt_logprobs(choice["prompt_logprobs"], PROMPT_IDS, reference, 1)
    # Without the field: no key (or null), as vLLM.
    plain = post(server, "/v1/completions", {"prompt": PROMPT_IDS, "max_tokens": 1}).json()["choices"][0]
    assert plain.get("prompt_logprobs") is None
    # k = 0: the prompt token only; k = 3 several prompts in one request (a batch with and without).
    body = {"prompt": [PROMPT_IDS, PROMPT_IDS[:5]], "max_tokens": 2, "prompt_logprobs": 0, "temperature": 0}
    choices = post(server, "/v1/completions", body).json()["choices"]
    check_prompt_logprobs(choices[0]["prompt_logprobs"], PROMPT_IDS, reference, 0)
    check_prompt_logprobs(choices[1]["prompt_logprobs"], PROMPT_IDS[:5], reference, 0)


def test_chat_prompt_logprobs(server: RemoteServer) -> None:
    body = {"messages": [{"role": "user", "content": "Who won the world series in 2020?"}], "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": 2, "return_token_ids": True}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    check_prompt_logprobs(data["prompt_logprobs"], data["prompt_token_ids"], None, 2)
    assert "prompt_logprobs" not in data["choices"][0] or data["choices"][0]["prompt_logprobs"] is None


@pytest.mark.parametrize("path,extra", [("/v1/completions", {"prompt": "hi"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
@pytest.mark.parametrize("value", [1, -1])
def test_refused_with_stream(server: RemoteServer, path: str, extra: dict[str, Any], value: int) -> None:
    resp = post(server, path, {**extra, "prompt_logprobs": value, "stream": True})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith("`prompt_logprobs` are not available when `stream=True`.")
    assert resp.json()["error"]["param"] == "prompt_logprobs"
    resp = post(server, path, {**extra, "prompt_logprobs": -2})
    assert resp.status_code == 400 and "prompt_logprobs" in resp.json()["error"]["message"]
    # 0 with stream is vLLM's exception (nothing beyond the prompt token itself is asked for).
    assert post(server, path, {**extra, "prompt_logprobs": 0, "stream": True, "max_tokens": 1}).status_code == 200


def test_echo(server: RemoteServer, reference: torch.Tensor) -> None:
    text = "The quick brown fox"
    base = {"prompt": text, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = post(server, "/v1/completions", base).json()["choices"][0]
    echoed = post(server, "/v1/completions", {**base, "echo": True}).json()["choices"][0]
    assert echoed["text"] == text + plain["text"]
    # echo with max_tokens 0: the prompt alone (OpenAI; vLLM generates one token and drops it).
    only = post(server, "/v1/completions", {**base, "echo": True, "max_tokens": 0, "logprobs": 1,
                                            "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert only["text"] == text
    lp = only["logprobs"]
    n = len(lp["tokens"])
    assert n == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) > 1
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert lp["tokens"][0] == "<s>" and "".join(lp["tokens"][1:]) == text  # the BOS the tokenizer added first
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    # echo + logprobs with generation: the prompt's positions, then the generated tokens'; on token ids the
    # values are the reference's.
    body = {"prompt": PROMPT_IDS, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1,
            "ignore_eos": True, "return_token_ids": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT_IDS) + 2
    assert lp["tokens"][:len(PROMPT_IDS)] == [f"token_id:{t}" for t in PROMPT_IDS]  # the server flag
    expected = [reference[j - 1, PROMPT_IDS[j]].item() for j in range(1, len(PROMPT_IDS))]
    assert lp["token_logprobs"][1:len(PROMPT_IDS)] == pytest.approx(expected, abs=2e-4)
    check_prompt_logprobs(choice["prompt_logprobs"], PROMPT_IDS, reference, 1)
    # Streamed: the first chunk starts with the prompt (text and logprobs), the chunks add up to the whole.
    resp = post(server, "/v1/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    chunks = [json.loads(line[6:])["choices"] for line in resp.text.split("\n\n") if line.startswith("data: {")]
    streamed = [c[0] for c in chunks if c]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    tokens = [t for c in streamed for t in c["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]
    values = [v for c in streamed for v in c["logprobs"]["token_logprobs"]]
    assert values[0] is None and values[1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-6)


def test_return_tokens_as_token_ids(server: RemoteServer) -> None:
    base = {"prompt": PROMPT_IDS[:6], "max_tokens": 3, "temperature": 0, "logprobs": 2, "ignore_eos": True,
            "return_token_ids": True}
    # The server runs with --return-tokens-as-token-ids: tokens are "token_id:{id}" unless a request says false.
    flagged = post(server, "/v1/completions", base).json()["choices"][0]
    assert flagged["logprobs"]["tokens"] == [f"token_id:{t}" for t in flagged["token_ids"]]
    assert all(k.startswith("token_id:") for top in flagged["logprobs"]["top_logprobs"] for k in top)
    text = post(server, "/v1/completions", {**base, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(t.startswith("token_id:") for t in text["logprobs"]["tokens"])
    assert text["token_ids"] == flagged["token_ids"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True, "ignore_eos": True}
    choice = post(server, "/v1/chat/completions", chat).json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])
    choice = post(server, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": False}).json()["choices"][0]
    assert not any(c["token"].startswith("token_id:") for c in choice["logprobs"]["content"])
    resp = post(server, "/v1/completions", {**base, "return_tokens_as_token_ids": "yes"})
    assert resp.status_code == 400


def test_n_samples(server: RemoteServer, reference: torch.Tensor) -> None:
    """n > 1: the prompt logprobs once per request (streamed: in one chunk), and with echo every sample's first
    chunk starts with the prompt's logprobs, also a sample whose first chunk comes after the others'."""
    body = {"token_ids": PROMPT_IDS, "stream": True,
            "sampling_params": {"max_tokens": 3, "n": 3, "temperature": 1.0, "prompt_logprobs": 1, "seed": 1}}
    resp = post(server, "/inference/v1/generate", body)
    assert resp.status_code == 200, resp.text
    events = [json.loads(line[6:]) for line in resp.text.split("\n\n") if line.startswith("data: {")]
    carried = [e["prompt_logprobs"] for e in events if e.get("prompt_logprobs") is not None]
    assert len(carried) == 1
    check_prompt_logprobs(carried[0], PROMPT_IDS, reference, 1)
    body = {"prompt": PROMPT_IDS, "max_tokens": 3, "n": 3, "temperature": 1.0, "echo": True, "logprobs": 0,
            "stream": True, "seed": 2}
    resp = post(server, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    firsts: dict[int, Any] = {}
    for line in resp.text.split("\n\n"):
        if line.startswith("data: {"):
            for c in json.loads(line[6:])["choices"]:
                firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1, 2]
    expected = [reference[j - 1, PROMPT_IDS[j]].item() for j in range(1, len(PROMPT_IDS))]
    for c in firsts.values():
        values = c["logprobs"]["token_logprobs"]
        assert values[0] is None
        assert values[1:len(PROMPT_IDS)] == pytest.approx(expected, abs=2e-4)
