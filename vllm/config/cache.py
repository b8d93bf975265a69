"""CacheConfig: the paged KV cache's block size, memory budget and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV cache block."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations and KV cache); CUDA only."""
    kv_cache_memory_bytes: int | None = None
    """Explicit KV cache size in bytes; on CPU the default is 1 GiB. Overrides gpu_memory_utilization."""
    num_gpu_blocks_override: int | None = None
    """Use exactly this many KV blocks (tests and debugging)."""
    enable_prefix_caching: bool | None = None
    """Automatic prefix caching (on unless False, as in vLLM): full KV blocks are kept, after their request ended,
    under a digest of their tokens (and the request's cache_salt), and a new request starts computing after its
    longest cached prefix; freed cached blocks are evicted least recently used first (docs/serving.md)."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}.")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be at least 1, got {self.num_gpu_blocks_override}.")
        if self.enable_prefix_caching is None:
            self.enable_prefix_caching = True
