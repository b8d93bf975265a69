"""Test-wide setup: without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module defines a kernel, so it is set here, before collection.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_interpret_unchanged():
    """A test that leaves TRITON_INTERPRET changed sends every later test's kernels down another path (on a GPU
    machine: CPU tensors into compiled kernels), so the change is an error of that test."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    after = os.environ.get("TRITON_INTERPRET")
    if after != before:
        os.environ.pop("TRITON_INTERPRET", None) if before is None else os.environ.update(TRITON_INTERPRET=before)
        pytest.fail(f"the test changed TRITON_INTERPRET ({before!r} -> {after!r}); use monkeypatch or leave it")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """TEST_SHARD=i/n (tools/gpu_run.sh's cuda_tests stage): run the i-th of n parts of the collected tests,
    test files taken in turn, the rest deselected.

    NOTE: the parts are chosen after collecting the whole suite, not by passing a list of files: files of several
    directories given at once import every directory's conftest.py first, and `from conftest import ...` in a test
    module then finds another directory's."""
    shard = os.environ.get("TEST_SHARD")
    if not shard:
        return
    index, _, count = shard.partition("/")
    i, n = int(index), int(count)
    if not 1 <= i <= n:
        raise pytest.UsageError(f"TEST_SHARD={shard!r}: expected i/n with 1 <= i <= n")
    files = sorted({item.path for item in items})
    keep = {path for k, path in enumerate(files) if k % n == i - 1}
    selected = [item for item in items if item.path in keep]
    config.hook.pytest_deselected(items=[item for item in items if item.path not in keep])
    items[:] = selected
