"""The executors: how an engine core runs its workers, one per tensor-parallel rank (vllm/v1/executor/abstract.py)."""

from vllm.v1.executor.abstract import Executor
from vllm.v1.executor.uniproc_executor import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
