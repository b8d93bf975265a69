"""Worker tests: CUDA graphs of one test are destroyed before the next test starts.

NOTE: the runners' graph managers sit in reference cycles (tests wrap their methods), so without a collection
they die at an arbitrary point of a later test; on some PyTorch versions destroying a graph frees the cuBLAS
workspace other live graphs still point at, which can break every CUDA test after it."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _collect_cuda_graphs() -> Iterator[None]:
    yield
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.synchronize()
