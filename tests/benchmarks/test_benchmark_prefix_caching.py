"""benchmarks/benchmark_prefix_caching.py at tiny sizes on CPU (bundled model, block_size 4), offline and served,
with the prefix-cache counters the run reports checked against hand-worked counts.

GRPO, 2 groups of a 16-token prompt, n = 4: each child looks up its 16 tokens (128 in all); in each group the
first child computes the prompt and the 3 others hit its first 3 blocks (12 tokens: a hit stops short of the
last token, and 16 is a block boundary), so 2 * 3 * 12 = 72 hits.
Multi-turn, 2 sessions of 3 turns, 5 new user tokens and 3 output tokens per turn: the prompts are 5, 13 and 21
tokens (78 looked up). A turn's request computed its prompt and all but its last output token (5 + 2 = 7,
then 13 + 2 = 15 tokens): 1, then 3 full blocks, so the turns hit 0, 4 and 12 tokens: 2 * 16 = 32 hits.
"""

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
import benchmark_prefix_caching as bpc  # noqa: E402

GRPO = ["--workload", "grpo", "--num-groups", "2", "--prompt-len", "16", "--n", "4", "--output-len", "3"]
MULTI_TURN = ["--workload", "multi-turn", "--num-sessions", "2", "--turns", "3", "--turn-len", "5",
              "--output-len", "3"]


@pytest.mark.parametrize("workload,queries,hits", [(GRPO, 128, 72), (MULTI_TURN, 78, 32)], ids=["grpo", "multi"])
def test_offline_counts(workload: list[str], queries: int, hits: int) -> None:
    on = bpc.main(["--device", "cpu", "--block-size", "4", *workload])
    assert (on["queries"], on["hits"], on["prompt_tokens_computed"]) == (queries, hits, queries - hits)
    assert on["prompt_tokens"] == queries and on["prefix_caching"] is True
    off = bpc.main(["--device", "cpu", "--block-size", "4", "--no-enable-prefix-caching", *workload])
    assert (off["hits"], off["prefix_caching"]) == (0, False)
    assert off["output_tokens"] == on["output_tokens"] == (24 if workload is GRPO else 18)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    model = default_model_path()
    port = _free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1", "--port",
         str(port), "--device", "cpu", "--skip-tokenizer-init", "--block-size", "4", "--max-model-len", "64",
         "--uvicorn-log-level", "warning"],
        cwd=REPO_ROOT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, "the server exited"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("workload,queries,hits", [(GRPO, 128, 72), (MULTI_TURN, 78, 32)], ids=["grpo", "multi"])
def test_served_counts(server_url: str, workload: list[str], queries: int, hits: int) -> None:
    row = bpc.main(["--base-url", server_url, *workload])
    assert (row["queries"], row["hits"], row["prompt_tokens"]) == (queries, hits, queries)
    assert row["prefix_caching"] is None
