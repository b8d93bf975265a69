"""Tensor collectives over a StatelessProcessGroup (vLLM's module path: RL frameworks import from here)."""
