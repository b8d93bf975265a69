"""benchmarks/benchmark_throughput.py on the bundled model (CPU): one level with masks, each output token's mask
counted, in process and with the engine core in its own process (the GPU stage `offline_mask` runs both), and
through an AsyncLLM (`--async-engine`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("multiprocessing,extra", [("0", []), ("1", []), ("0", ["--async-engine"])],
                         ids=["inproc", "mp", "async"])
def test_offline_levels_with_masks_are_checked(multiprocessing: str, extra: list[str]) -> None:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing,
               PYTHONPATH=os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p))
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "benchmark_throughput.py"), "--model",
           os.path.join(REPO_ROOT, "vllm", "assets", "tiny-llama"), "--device", "cpu", "--max-num-seqs", "8",
           "--num-prompts", "3", "--input-len", "8", "--output-len", "5", "--top-k", "7", "--logprobs", "1",
           "--logprobs-mode", "processed_logprobs", "--return-sampling-mask", "--warmup-prompts", "1", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 3 |")]
    # 3 requests, and every one of their 5 tokens came with a non-empty mask.
    assert len(rows) == 1 and rows[0].rstrip().endswith("| ok |"), proc.stdout
