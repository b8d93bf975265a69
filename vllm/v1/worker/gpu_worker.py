"""vLLM's module path of the worker (RL frameworks import `vllm.v1.worker.gpu_worker.Worker` for type hints and
extension base classes): the one Worker, whatever the device."""

from vllm.v1.worker.worker import Worker

__all__ = ["Worker"]
