"""benchmarks/benchmark_serving.py: CPU lists, the in-process client's pinning, and one tiny run against a real
`vllm serve` (bundled tiny model, CPU, sampling masks on) whose token and mask counts are known in advance."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from vllm.config.model import default_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import benchmark_serving as bs  # noqa: E402
import serving_metrics as sm  # noqa: E402


def test_cpu_lists_parse_as_taskset_writes_them() -> None:
    assert bs.parse_cpu_list("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    assert bs.parse_cpu_list("5") == {5}
    for bad in ("", "3-1", "-1", "a"):
        with pytest.raises(ValueError):
            bs.parse_cpu_list(bad)


def test_pinned_in_process_client_restores_the_affinity() -> None:
    """A level run in this process with --cpus pins it for the level only (a server started later inherits it)."""
    before = os.sched_getaffinity(0)
    records, _, _ = bs.run_level("http://127.0.0.1:9/v1/completions", {}, [[1, 2]], 1, 1, 5.0, None, "parse",
                                 [min(before)])
    assert records[0].error is not None  # nothing listens there: the request fails at once
    assert os.sched_getaffinity(0) == before


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    model = default_model_path()
    if not os.path.isfile(os.path.join(model, "config.json")):
        pytest.skip(f"model folder {model} is missing")
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port",
         str(port), "--device", "cpu", "--skip-tokenizer-init", "--return-sampling-mask", "--logprobs-mode",
         "processed_logprobs", "--max-model-len", "64", "--uvicorn-log-level", "warning"],
        cwd=REPO_ROOT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with code {proc.returncode} during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("vllm serve did not become healthy in time")
            try:
                if httpx.get(f"{url}/health", timeout=1, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


@pytest.mark.parametrize("mask_check", sm.MASK_CHECKS)
def test_load_against_server_counts_tokens_and_masks(server_url: str, mask_check: str) -> None:
    args = bs.make_parser().parse_args(
        ["--base-url", server_url, "--concurrency", "2", "--num-prompts", "3", "--input-len", "6", "--output-len",
         "4", "--temperature", "1", "--top-p", "0.9", "--top-k", "7", "--logprobs", "1", "--num-warmups", "1",
         "--warmup-output-len", "2", "--num-client-procs", "1", "--mask-check", mask_check])
    bs.validate(args)
    (r,) = bs.run_benchmark(args, log=lambda _: None)
    assert r["concurrency"] == 2 and r["num_prompts"] == 3
    assert r["completed"] == 3 and r["failed"] == 0 and r["timed_out"] == 0 and not r["truncated"]
    # ignore_eos with max_tokens=4: exactly 4 tokens per request, counted both from usage and from the chunks.
    assert r["output_tokens"] == 12 and r["token_count_mismatches"] == 0
    assert r["masks_ok"] is True and r["mask_requests"] == 3 and r["masks_received"] == 12
    assert 1.0 <= r["mean_mask_size"] <= 7.0
    assert r["output_throughput"] == pytest.approx(12 / r["duration_s"])
    assert 0 < r["ttft_ms_median"] <= r["e2e_ms_median"] and r["tpot_ms_median"] > 0
    table = sm.markdown_table([r])
    assert "| 2 | 3/3 |" in table and "| ok |" in table


def test_no_mask_server_reports_no_mask_check(server_url: str) -> None:
    args = bs.make_parser().parse_args(
        ["--base-url", server_url, "--concurrency", "1", "--num-prompts", "1", "--input-len", "5", "--output-len",
         "3", "--top-k", "5", "--num-warmups", "0", "--extra-body", '{"return_sampling_mask": false}'])
    (r,) = bs.run_benchmark(args, log=lambda _: None)
    assert r["completed"] == 1 and r["output_tokens"] == 3
    assert r["masks_ok"] is None and r["mask_requests"] == 0


@pytest.mark.parametrize("endpoint", ["completions", "generate"])
def test_non_streamed_load_counts_tokens_and_masks(server_url: str, endpoint: str) -> None:
    """--no-stream: one body per request, its tokens (usage and token_ids) and masks counted as a stream's."""
    args = bs.make_parser().parse_args(
        ["--base-url", server_url, "--endpoint", endpoint, "--no-stream", "--concurrency", "2", "--num-prompts", "3",
         "--input-len", "6", "--output-len", "4", "--temperature", "1", "--top-p", "0.9", "--top-k", "7",
         "--logprobs", "1", "--num-warmups", "1", "--warmup-output-len", "2", "--num-client-procs", "1",
         "--mask-check", "count"])
    (r,) = bs.run_benchmark(args, log=lambda _: None)
    assert r["completed"] == 3 and r["failed"] == 0 and r["output_tokens"] == 12
    assert r["token_count_mismatches"] == 0
    assert r["masks_ok"] is True and r["mask_requests"] == 3 and r["masks_received"] == 12
    assert 1.0 <= r["mean_mask_size"] <= 7.0
    assert r["ttft_ms_median"] == pytest.approx(r["e2e_ms_median"], rel=0.2)  # the first token is the whole body


def test_payloads_per_endpoint() -> None:
    """Each endpoint's request fields: generate's sampling settings under sampling_params, chat's logprobs as
    top_logprobs and its prompt as "<id>" words, token ids asked for in non-streamed completions."""
    base = ["--top-k", "5", "--logprobs", "1", "--temperature", "0.5"]
    gen = bs.build_payload(bs.make_parser().parse_args(base + ["--endpoint", "generate", "--no-stream"]), "m", 9)
    assert gen == {"model": "m", "stream": False, "sampling_params": {
        "max_tokens": 9, "ignore_eos": True, "temperature": 0.5, "top_p": 1.0, "top_k": 5, "logprobs": 1}}
    chat = bs.build_payload(bs.make_parser().parse_args(base + ["--endpoint", "chat"]), "m", 9)
    assert chat["logprobs"] is True and chat["top_logprobs"] == 1 and chat["stream"] is True
    assert chat["stream_options"] == {"include_usage": True} and "return_token_ids" not in chat
    cmpl = bs.build_payload(bs.make_parser().parse_args(base + ["--no-stream"]), "m", 9)
    assert cmpl["return_token_ids"] is True and cmpl["logprobs"] == 1 and "stream_options" not in cmpl
    assert bs.prompt_field("chat", [5, 17]) == {"messages": [{"role": "user", "content": "<5><17>"}]}
    assert bs.prompt_field("generate", [5]) == {"token_ids": [5]} and bs.prompt_field("completions", [5]) == {
        "prompt": [5]}
