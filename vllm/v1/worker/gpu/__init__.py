"""Upstream vLLM's model-runner-v2 package path (`vllm.v1.worker.gpu`), kept only for the names RL code imports
from it; this engine's runner is vllm/v1/worker/model_runner.py."""
