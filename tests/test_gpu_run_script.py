"""tools/gpu_run.sh's `cuda_tests` stage runs the whole test suite (run here with a stand-in python3 that records
its arguments: no GPU needed), in SHARD=i/n parts (tests/conftest.py's TEST_SHARD) that together are the whole
suite, and the script's header says so."""

from __future__ import annotations

import os
import stat
import importlib.util
import subprocess

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO_ROOT, "tools", "gpu_run.sh")
# tests/conftest.py by path (`import conftest` may find another directory's)
_spec = importlib.util.spec_from_file_location("root_conftest", os.path.join(REPO_ROOT, "tests", "conftest.py"))
root_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(root_conftest)


def _stage_call(tmp_path, shard: str | None) -> tuple[list[str], str]:
    """The arguments and TEST_SHARD the stage hands to pytest (a stand-in python3 records them)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python3"
    calls_file = tmp_path / "calls.txt"
    calls_file.unlink(missing_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$TEST_SHARD|$@" >> {calls_file}\necho "642 passed in 1.00s"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "OUT": str(out)}
    env.pop("SHARD", None)
    if shard is not None:
        env["SHARD"] = shard
    proc = subprocess.run(["bash", SCRIPT, "cuda_tests"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = [line.partition("|") for line in calls_file.read_text().splitlines()]
    pytest_calls = [(args.split(), test_shard) for test_shard, _, args in calls if args.startswith("-m pytest")]
    assert len(pytest_calls) == 1
    assert "642 passed" in (out / "cuda_suite.txt").read_text()
    assert "642 passed" in (out / "cuda_suite_full.txt").read_text()
    return pytest_calls[0]


def test_cuda_tests_stage_runs_the_whole_suite(tmp_path) -> None:
    args, test_shard = _stage_call(tmp_path, None)
    assert args[-1] == "tests" and not [a for a in args if a.startswith("tests/")] and test_shard == ""
    args, test_shard = _stage_call(tmp_path, "2/3")
    assert args[-1] == "tests" and test_shard == "2/3"


class _Item:
    def __init__(self, path: str) -> None:
        self.path = path


class _Config:
    def __init__(self) -> None:
        self.deselected: list[_Item] = []
        self.hook = self

    def pytest_deselected(self, items: list[_Item]) -> None:
        self.deselected += items


def test_shards_split_the_suite_by_file(monkeypatch) -> None:
    """tests/conftest.py's TEST_SHARD: the parts are disjoint, cover every test, keep a file's tests together and
    differ by at most one file (a hand-made suite of 5 files)."""
    items = [_Item(f"t{f}.py") for f in (0, 0, 1, 2, 2, 2, 3, 4)]
    parts = []
    for i in (1, 2):
        monkeypatch.setenv("TEST_SHARD", f"{i}/2")
        kept, config = list(items), _Config()
        root_conftest.pytest_collection_modifyitems(config, kept)
        assert sorted(map(id, kept + config.deselected)) == sorted(map(id, items))
        parts.append(kept)
    assert [i.path for i in parts[0]] == ["t0.py", "t0.py", "t2.py", "t2.py", "t2.py", "t4.py"]
    assert [i.path for i in parts[1]] == ["t1.py", "t3.py"]
    monkeypatch.setenv("TEST_SHARD", "3/2")
    with pytest.raises(pytest.UsageError):
        root_conftest.pytest_collection_modifyitems(_Config(), list(items))
    monkeypatch.delenv("TEST_SHARD")
    kept = list(items)
    root_conftest.pytest_collection_modifyitems(_Config(), kept)
    assert kept == items


def test_the_header_documents_the_stage() -> None:
    with open(SCRIPT) as f:
        header = [line for line in f if line.startswith("#")]
    assert any("`cuda_tests`" in line and "whole test suite" in line for line in header)
