"""tools/gpu_run.sh's `cuda_tests` stage runs the whole test suite (run here with a stand-in python3 that records
its arguments: no GPU needed), and the script's header says so."""

from __future__ import annotations

import os
import stat
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu_run.sh")


def test_cuda_tests_stage_runs_the_whole_suite(tmp_path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "python3"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls.txt\necho "642 passed in 1.00s"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out)}
    proc = subprocess.run(["bash", SCRIPT, "cuda_tests"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in (tmp_path / "calls.txt").read_text().splitlines()]
    pytest_calls = [c for c in calls if c[:2] == ["-m", "pytest"]]
    assert len(pytest_calls) == 1 and pytest_calls[0][-1] == "tests"  # the suite's root, no subset
    assert "642 passed" in (out / "cuda_suite.txt").read_text()
    assert "642 passed" in (out / "cuda_suite_full.txt").read_text()


def test_the_header_documents_the_stage() -> None:
    with open(SCRIPT) as f:
        header = [line for line in f if line.startswith("#")]
    assert any("`cuda_tests`" in line and "whole test suite" in line for line in header)
