"""tools/profiling/offline_host.py: offline LLM.generate over the replay engine core, each arm in its own process;
every request gets all its tokens (and with masks one mask per token, checked inside the run)."""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "profiling"))
import offline_host  # noqa: E402


import pytest


@pytest.mark.parametrize("multiprocessing", ["0", "1"])
def test_both_arms_run_every_token(monkeypatch, multiprocessing: str) -> None:
    """In process, and with the replay core in its own process (VLLM_ENABLE_V1_MULTIPROCESSING=1)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    results = offline_host.main(["--num-reqs", "6", "--output-len", "5", "--repeats", "1", "--mask-size", "9"])
    assert [r["arm"] for r in results] == ["no-mask", "mask"]
    for r in results:
        assert r["tokens"] == 6 * 5 and r["ms_per_step"] > 0 and r["cpu_us_per_token"] > 0
        assert r["multiprocess"] is (multiprocessing == "1")
