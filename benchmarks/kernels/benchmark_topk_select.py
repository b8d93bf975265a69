"""Device time of the top-k candidate select: torch.topk + a counting read ("topk"), the radix kernel ("row")
and the chunk-maximum prefilter ("prefilter"; "prefilter_v1" is its first version, kept here for comparison:
torch.topk over the chunk maxima, a gather of 1024-id programs through a per-row atomic counter, torch.topk and a
sort over the buffer).

Setting (benchmark_sampler.py's): V=151936, top_k=512 for every row, temperature 1, logits = randn * 3
rounded through bf16 (held as float32, or as bf16 with --dtype bfloat16), C = 640 (fast_path.num_candidates
for max_top_k=512); num_reqs in {64, 256, 512, 1024}. References in the same table: torch.topk(k=513) and one
read of the logits (`logits.amax(-1)`). "prefilter_1ovf" is the prefilter on the same logits but for row 0,
whose first 2 * cap ids hold the row's largest values: its buffer overflows and its row program selects it from
its ~k listed chunks (the cost of one overflow row). "prefilter_1radix": row 0 also has 20.0 (above every other
value, below the cluster) as the first id of every chunk, so all 4748 chunks are listed (> 2C) and the radix kernel
selects it (the last resort's cost). "prefilter_allovf": every row's first 2 * cap ids hold its largest values
(every row overflows and is selected in its row program: the worst case short of ties).

Each entry is the mean time of one CUDA-graph replay over --iters replays (no launch overhead). Before timing,
"topk", "prefilter" and "prefilter_v1" (both inputs) are checked to give the row kernel's outputs.

On a machine without CUDA it runs a smoke test under TRITON_INTERPRET on tiny shapes (wall-clock times of the
interpreter, meaningless as performance).

Usage: python benchmarks/kernels/benchmark_topk_select.py [--out results.json] [--iters 100] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from vllm.v1.sample.ops import topk_prefilter, topk_select  # noqa: E402
from vllm.v1.sample.ops.topk_select import TopKCandidates, select_top_k_candidates  # noqa: E402

VOCAB_SIZE = 151936
NUM_REQS = (64, 256, 512, 1024)
TOP_K = 512
NUM_CAND = 640


def time_graph_ms(fn: Callable[[], object], iters: int) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def time_wall_ms(fn: Callable[[], object], iters: int) -> float:
    fn()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - begin) * 1e3 / iters


@triton.jit
def _gather_above_kernel(
    logits_ptr,  # [num_reqs, V] float
    logits_stride,
    temperature_ptr,  # [num_reqs] float32
    t0_ptr,  # [num_reqs] float32
    num_above_ptr,  # [num_reqs] int32, zeroed
    buf_ids_ptr,  # [num_reqs, cap] int32
    buf_values_ptr,  # [num_reqs, cap] float32
    vocab_size,
    cap,
    BLOCK_SIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    valid = offs < vocab_size
    x = tl.load(logits_ptr + row * logits_stride + offs, mask=valid, other=float("-inf")).to(tl.float32)
    z = tl.math.div_rn(x, tl.load(temperature_ptr + row))
    keep = valid & (z >= tl.load(t0_ptr + row)) & (z > float("-inf"))
    flags = keep.to(tl.int32)
    # NOTE: one atomic per 1024 ids reserves the program's slots (arbitrary order; the sort below fixes it).
    base = tl.atomic_add(num_above_ptr + row, tl.sum(flags, axis=0), sem="relaxed")
    slots = base + tl.cumsum(flags, axis=0) - flags
    held = keep & (slots < cap)
    tl.store(buf_ids_ptr + row * cap + slots, offs, mask=held)
    tl.store(buf_values_ptr + row * cap + slots, z, mask=held)


def select_prefilter_v1(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, num_cand: int,
                        block_size: int, chunk: int, cap: int) -> TopKCandidates:
    """The first prefilter (temperature float32, top_k int32, both contiguous): the same outputs as "prefilter"."""
    num_reqs, vocab_size = logits.shape
    device = logits.device
    ids = torch.empty((num_reqs, num_cand), dtype=torch.int32, device=device)  # [num_reqs, C]
    values = torch.empty((num_reqs, num_cand), dtype=torch.float32, device=device)  # [num_reqs, C]
    counts = torch.empty((num_reqs,), dtype=torch.int32, device=device)  # [num_reqs]
    kth = torch.empty((num_reqs,), dtype=torch.float32, device=device)  # [num_reqs]
    num_chunks = triton.cdiv(vocab_size, chunk)
    grid = (num_reqs, triton.cdiv(vocab_size, block_size))
    chunk_max = torch.empty((num_reqs, num_chunks), dtype=torch.float32, device=device)  # [num_reqs, NCH]
    topk_prefilter._chunk_max_kernel[grid](logits, logits.stride(0), temperature, chunk_max, vocab_size,
                                           num_chunks, BLOCK_SIZE=block_size, CHUNK=chunk)
    k = top_k.to(torch.long).clamp(1, vocab_size)  # [num_reqs]
    width = min(num_cand, num_chunks)
    t0 = chunk_max.topk(width, dim=-1).values.gather(1, (k[:, None] - 1).clamp(max=width - 1))[:, 0]  # [num_reqs]
    t0 = torch.where(k > num_cand, float("inf"), torch.where(k > num_chunks, float("-inf"), t0))
    bad = (chunk_max == float("inf")).any(dim=-1)  # [num_reqs] bool
    num_above = torch.zeros((num_reqs,), dtype=torch.int32, device=device)  # [num_reqs]
    buf_ids = torch.empty((num_reqs, cap), dtype=torch.int32, device=device)  # [num_reqs, cap]
    buf_values = torch.empty((num_reqs, cap), dtype=torch.float32, device=device)  # [num_reqs, cap]
    _gather_above_kernel[grid](logits, logits.stride(0), temperature, t0, num_above, buf_ids, buf_values,
                               vocab_size, cap, BLOCK_SIZE=block_size)
    held = torch.arange(cap, device=device)[None, :] < num_above[:, None]  # [num_reqs, cap] bool
    buf_values = torch.where(held, buf_values, float("-inf"))
    top_values, top_slots = buf_values.topk(num_cand, dim=-1)  # [num_reqs, C] descending
    kth_z = top_values.gather(1, (k[:, None] - 1).clamp(max=num_cand - 1))  # [num_reqs, 1]
    num_ge = (buf_values >= kth_z).sum(dim=-1)  # [num_reqs]
    could_hold = ~bad & (k <= num_cand)  # [num_reqs] bool
    overflow = could_hold & (num_above > cap)  # [num_reqs] bool
    ok = could_hold & (num_ge <= num_cand) & (kth_z[:, 0] > float("-inf"))
    order_key, order = torch.where(top_values >= kth_z, buf_ids.gather(1, top_slots), vocab_size).sort(dim=-1)
    ids.copy_(order_key)
    values.copy_(top_values.gather(1, order))
    counts.copy_(torch.where(ok, num_ge, -1))
    kth.copy_(kth_z[:, 0])
    topk_select._run_row_kernel(logits, temperature, top_k, ids, values, counts, kth, block_size,
                                row_flag=overflow.to(torch.int32))
    return TopKCandidates(ids, values, counts, kth)


def same_outputs(a: TopKCandidates, b: TopKCandidates) -> bool:
    if not (torch.equal(a.counts, b.counts) and torch.equal(a.kth, b.kth)):
        return False
    valid = torch.arange(a.token_ids.shape[1], device=a.counts.device)[None, :] < a.counts[:, None]
    return bool(torch.equal(torch.where(valid, a.token_ids, 0), torch.where(valid, b.token_ids, 0))
                and torch.equal(torch.where(valid, a.values, 0.0), torch.where(valid, b.values, 0.0)))


def bench_row(num_reqs: int, vocab_size: int, top_k: int, num_cand: int, iters: int, block_size: int,
              device: torch.device, dtype: torch.dtype, cap: int) -> dict[str, float | int]:
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(num_reqs, vocab_size, device=device, generator=gen) * 3).to(torch.bfloat16).to(dtype)
    temperature = torch.ones(num_reqs, device=device)
    k = torch.full((num_reqs,), top_k, dtype=torch.int32, device=device)
    timer = time_graph_ms if device.type == "cuda" else time_wall_ms
    clustered = logits.clone()
    clustered[0, :2 * cap] = 40.0 + clustered[0, :2 * cap]
    tied = clustered.clone()
    tied[0, 2 * cap::32] = 20.0
    all_clustered = logits.clone()
    all_clustered[:, :2 * cap] = 40.0 + all_clustered[:, :2 * cap]

    def select(impl: str, x: torch.Tensor = logits) -> TopKCandidates:
        if impl == "prefilter_v1":
            return select_prefilter_v1(x, temperature, k, num_cand, block_size, 32, cap)
        return select_top_k_candidates(x, temperature, k, num_cand, use_triton=True, impl=impl,
                                       block_size=block_size, prefilter_cap=cap)

    for impl, x in (("topk", logits), ("prefilter", logits), ("prefilter", clustered), ("prefilter", tied),
                    ("prefilter", all_clustered),
                    ("prefilter_v1", logits), ("prefilter_v1", clustered)):
        if not same_outputs(select(impl, x), select("row", x)):
            raise SystemExit(f"{impl} differs from the row kernel at num_reqs={num_reqs}")
    return {
        "num_reqs": num_reqs, "vocab_size": vocab_size,
        "read_ms": timer(lambda: logits.amax(dim=-1), iters),
        f"torch_topk{top_k + 1}_ms": timer(lambda: logits.topk(top_k + 1, dim=-1), iters),
        "topk_ms": timer(lambda: select("topk"), iters),
        "row_ms": timer(lambda: select("row"), iters),
        "prefilter_ms": timer(lambda: select("prefilter"), iters),
        "prefilter_1ovf_ms": timer(lambda: select("prefilter", clustered), iters),
        "prefilter_1radix_ms": timer(lambda: select("prefilter", tied), iters),
        "prefilter_allovf_ms": timer(lambda: select("prefilter", all_clustered), iters),
        "prefilter_v1_ms": timer(lambda: select("prefilter_v1"), iters),
        "prefilter_v1_1ovf_ms": timer(lambda: select("prefilter_v1", clustered), iters),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the logits' dtype")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if torch.cuda.is_available():
        device = torch.device("cuda")
        # NOTE: cap 2048 is the prefilter's default at C = 640; named here for the overflow row.
        shapes, top_k, num_cand, block, iters, cap = NUM_REQS, TOP_K, NUM_CAND, 1024, args.iters, 2048
        vocab_size = VOCAB_SIZE
    else:
        # NOTE: interpreter smoke test: tiny shapes, a small block and a small prefilter buffer.
        device = torch.device("cpu")
        shapes, top_k, num_cand, block, iters, cap = (2,), 16, 64, 256, 1, 128
        vocab_size = 1500
    rows = [bench_row(n, vocab_size, top_k, num_cand, iters, block, device, dtype, cap) for n in shapes]
    columns = [c for c in rows[0] if c.endswith("_ms")]
    print(f"\ntop-k candidate select, V={vocab_size}, top_k={top_k}, C={num_cand}, {args.dtype} logits, "
          f"device={device.type} "
          f"({'CUDA-graph replay' if device.type == 'cuda' else 'interpreter wall clock'}), ms per call\n")
    print("| num_reqs | " + " | ".join(c[:-3] for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row in rows:
        print(f"| {row['num_reqs']} | " + " | ".join(f"{row[c]:.4f}" for c in columns) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                       "dtype": args.dtype, "top_k": top_k, "num_cand": num_cand, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
