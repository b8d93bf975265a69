"""Device time of the sampler's top-k candidate select (the chunk-maximum prefilter, ops/topk_select.py) against
its references: one read of the logits, torch.topk(k + 1) and the radix kernel on every row ("row", the
prefilter's last resort and the test reference's kernel). The retired alternatives ("topk": torch.topk over C
columns + a counting read; the first prefilter with atomics) are measured in docs/benchmarks.md and in git history.

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
the prefilter is checked to give the row kernel's outputs on every input.

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

from vllm.v1.sample.ops import topk_select  # noqa: E402
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

    def select(x: torch.Tensor = logits) -> TopKCandidates:
        return select_top_k_candidates(x, temperature, k, num_cand, use_triton=True, block_size=block_size,
                                       prefilter_cap=cap)

    def row(x: torch.Tensor = logits) -> TopKCandidates:
        out = TopKCandidates(torch.empty((num_reqs, num_cand), dtype=torch.int32, device=device),
                             torch.empty((num_reqs, num_cand), dtype=torch.float32, device=device),
                             torch.empty((num_reqs,), dtype=torch.int32, device=device),
                             torch.empty((num_reqs,), dtype=torch.float32, device=device))
        topk_select._run_row_kernel(x, temperature, k, *out, block_size)  # the radix kernel on every row
        return out

    for x in (logits, clustered, tied, all_clustered):
        if not same_outputs(select(x), row(x)):
            raise SystemExit(f"the prefilter differs from the row kernel at num_reqs={num_reqs}")
    return {
        "num_reqs": num_reqs, "vocab_size": vocab_size,
        "read_ms": timer(lambda: logits.amax(dim=-1), iters),
        f"torch_topk{top_k + 1}_ms": timer(lambda: logits.topk(top_k + 1, dim=-1), iters),
        "row_ms": timer(lambda: row(), iters),
        "prefilter_ms": timer(lambda: select(), iters),
        "prefilter_1ovf_ms": timer(lambda: select(clustered), iters),
        "prefilter_1radix_ms": timer(lambda: select(tied), iters),
        "prefilter_allovf_ms": timer(lambda: select(all_clustered), iters),
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
