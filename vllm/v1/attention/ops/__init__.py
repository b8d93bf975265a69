"""Triton kernels behind the Triton attention backend: the paged KV-cache write and unified varlen attention."""
