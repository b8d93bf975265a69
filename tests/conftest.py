"""Test-wide setup, applied before collection.

- TRITON_INTERPRET=1: without a GPU, Triton kernels run under the interpreter on CPU tensors. It must be set before
  any module defines a kernel.
- OMP_NUM_THREADS=1 (unless already set): one intra-op thread in every server, engine core and worker the tests
  start (they inherit the environment), on every machine, and in this process on a CPU machine. The CPU engines
  here run a tiny model whose ops last microseconds; with several threads per process, several processes (pytest,
  an API server, an engine core or two) make each parallel region wait for a descheduled thread: two threads on
  the 2-core CI machine, torch's default of 16 on the 16-core GPU host (where, without the variable, a
  data-parallel server test on CPU stalled for over nine minutes on 2026-12-06; a suspect only: 16 threads per
  process on this 2-core machine did not stall it).
  On a GPU machine this process keeps torch's threads for its CPU references.
"""

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # NOTE: measured on the 2-core machine with other work on it: tests/v1/e2e/test_sleep_mode.py took 20 s with one
    # thread against 171 s with two; a scaled_dot_product_attention call of the tiny model's decode shapes 0.16 ms
    # against 9 ms. With the machine to itself the two take the same time (tests/v1/e2e: 101 s against 104 s).
    # torch has read the variable already in this process, hence set_num_threads too.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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
