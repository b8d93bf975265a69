"""Test-wide setup: without a GPU, Triton kernels run under the interpreter on CPU tensors.

TRITON_INTERPRET must be set before any module defines a kernel, so it is set here, before collection.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
