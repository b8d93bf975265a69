"""Upstream's `vllm.v1.worker.gpu.sample` path: re-exports only (see output.py)."""
