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
