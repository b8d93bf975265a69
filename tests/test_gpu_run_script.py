"""tools/gpu_run.sh's `cuda_tests` stage runs the whole test suite (run here with a stand-in python3 that records
its arguments: no GPU needed), in SHARD=i/n parts that together are the whole suite, and the script's header says
so."""

from __future__ import annotations

import os
import stat
import subprocess

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu_run.sh")


def _pytest_files(tmp_path, shard: str | None) -> list[str]:
    """The test files the stage hands to pytest (a stand-in python3 records its arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    calls_file = tmp_path / "calls.txt"
    calls_file.unlink(missing_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls_file}\necho "642 passed in 1.00s"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out)}
    env.pop("SHARD", None)
    if shard is not None:
        env["SHARD"] = shard
    proc = subprocess.run(["bash", SCRIPT, "cuda_tests"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [line.split() for line in calls_file.read_text().splitlines()]
    pytest_calls = [c for c in calls if c[:2] == ["-m", "pytest"]]
    assert len(pytest_calls) == 1
    assert "642 passed" in (out / "cuda_suite.txt").read_text()
    assert "642 passed" in (out / "cuda_suite_full.txt").read_text()
    return [a for a in pytest_calls[0] if a.startswith("tests/")]


def test_cuda_tests_stage_runs_the_whole_suite(tmp_path) -> None:
    every = sorted(os.path.relpath(os.path.join(d, f), REPO_ROOT)
                   for d, _, files in os.walk(os.path.join(REPO_ROOT, "tests"))
                   for f in files if f.startswith("test_") and f.endswith(".py"))
    assert sorted(_pytest_files(tmp_path, None)) == every
    halves = [_pytest_files(tmp_path, "1/2"), _pytest_files(tmp_path, "2/2")]
    assert not set(halves[0]) & set(halves[1]) and sorted(halves[0] + halves[1]) == every
    assert abs(len(halves[0]) - len(halves[1])) <= 1


def test_the_header_documents_the_stage() -> None:
    with open(SCRIPT) as f:
        header = [line for line in f if line.startswith("#")]
    assert any("`cuda_tests`" in line and "whole test suite" in line for line in header)
