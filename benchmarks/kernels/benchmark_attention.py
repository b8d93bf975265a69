"""Times the Triton decode attention path on CUDA and reports achieved KV-cache bandwidth.

Default shape is Qwen2.5-1.5B's attention (12 query heads, 2 KV heads, head_size 128, 28 layers), bf16,
block_size 16, every request decoding one token at `--context` tokens of context. GPU times are replayed
from a CUDA graph (as the engine runs decode), so they exclude Python launch overhead; the eager column
includes it. Reports the attention kernel per layer, the backend's forward (cache write + attention) per layer
and over all layers of a step, and the bandwidth of the KV bytes the kernel must read against 4.8 TB/s.

    PYTHONPATH=. python benchmarks/kernels/benchmark_attention.py --batch-sizes 64 256 512 --context 384
"""

from __future__ import annotations

import argparse

import torch

PEAK_BW = 4.8e12  # bytes/s, H200 HBM3e datasheet


def bench_one(batch: int, context: int, num_heads: int, num_kv_heads: int, head_size: int, num_layers: int,
              block_size: int, dtype: torch.dtype, num_splits: int | None) -> None:
    import triton

    from vllm.v1.attention.backends.abstract import AttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
    from vllm.v1.attention.ops.triton_unified_attention import TILE_N, _choose_num_splits, unified_attention

    device = torch.device("cuda")
    blocks_per_req = (context + block_size - 1) // block_size
    num_blocks = batch * blocks_per_req
    block_table = torch.randperm(num_blocks, device=device).int().view(batch, blocks_per_req)  # [batch, nb]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
    pos = context - 1
    slot_mapping = (block_table[:, pos // block_size].long() * block_size + pos % block_size)  # [batch] int64
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)
    query = torch.randn(batch, num_heads, head_size, dtype=dtype, device=device)
    key = torch.randn(batch, num_kv_heads, head_size, dtype=dtype, device=device)
    value = torch.randn_like(key)
    output = torch.empty_like(query)
    meta = AttentionMetadata(
        num_actual_tokens=batch, num_reqs=batch, max_query_len=1, max_seq_len=context,
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping,
        query_start_loc_cpu=query_start_loc.cpu(), seq_lens_cpu=seq_lens.cpu())
    scale = head_size ** -0.5
    backend = TritonAttentionBackend()

    def attn() -> None:
        unified_attention(query, kv_cache[0], kv_cache[1], output, query_start_loc, seq_lens, block_table, scale,
                          batch, batch, 1, context, num_splits=num_splits)

    def forward() -> None:
        backend.forward(query, key, value, kv_cache, meta, scale)

    attn()
    forward()
    ms_attn = triton.testing.do_bench_cudagraph(attn, rep=200)
    ms_fwd = triton.testing.do_bench_cudagraph(forward, rep=200)
    ms_eager = triton.testing.do_bench(forward, warmup=50, rep=200)
    kv_bytes = 2 * batch * context * num_kv_heads * head_size * kv_cache.element_size()
    bw = kv_bytes / (ms_attn * 1e-3)
    splits = _choose_num_splits(1, context, batch, num_kv_heads, TILE_N, num_splits)
    print(f"{batch:>6} {context:>8} {splits:>7} {ms_attn * 1e3:>11.1f} {ms_fwd * 1e3:>11.1f} "
          f"{ms_fwd * num_layers:>12.3f} {ms_eager * 1e3:>12.1f} {kv_bytes / 1e6:>8.1f} {bw / 1e12:>7.2f} "
          f"{100 * bw / PEAK_BW:>7.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--num-heads", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=28)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--num-splits", type=int, default=None, help="force the split-KV factor (default: auto)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_attention.py needs a CUDA device.")
    print(f"decode, {args.num_heads} q heads / {args.num_kv_heads} kv heads, head_size {args.head_size}, "
          f"block_size {args.block_size}, {args.dtype}, {torch.cuda.get_device_name()}")
    print(f"{'batch':>6} {'context':>8} {'splits':>7} {'attn us/lyr':>11} {'fwd us/lyr':>11} "
          f"{'fwd ms/step':>12} {'eager us/lyr':>12} {'KV MB':>8} {'TB/s':>7} {'of peak':>8}")
    for batch in args.batch_sizes:
        bench_one(batch, args.context, args.num_heads, args.num_kv_heads, args.head_size, args.num_layers,
                  args.block_size, getattr(torch, args.dtype), args.num_splits)


if __name__ == "__main__":
    main()
