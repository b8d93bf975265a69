"""The `vllm` command line (see main.py)."""
