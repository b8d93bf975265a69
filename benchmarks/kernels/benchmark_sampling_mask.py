"""Kernel-level benchmark of the sampling mask: compact path vs the pre-change full-bitmask path.

For each (num_reqs, k): fp32 logits [num_reqs, V] that are -inf except a random support of 1..k ids per row.
Measured per step:
- compact: GPU time of SamplingMaskTensors.from_logits + to_cpu_nonblocking (until the host copy is done),
  the kernel alone, host time of tolists(), bytes copied device -> host;
- legacy: the pre-change path, defined here as the baseline (isfinite() packed into the full bitmask on the
  device, all of it copied, unpacked with np.unpackbits + np.nonzero on the host): GPU time of the pack + copy,
  host time of the unpack, bytes copied;
- the floor: one read of the logits, measured (a row max) and at the nominal bandwidth (--bandwidth-tbps).

Prints a markdown table and writes JSON to --out. Runs on CUDA; on a machine without CUDA it runs the CPU
path with wall-clock timings (a smoke test, use small shapes).

    python benchmarks/kernels/benchmark_sampling_mask.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm.v1.outputs import SamplingMaskLists
from vllm.v1.sample.ops.mask_compaction import (compact_sampling_mask_chunked, launch_compact, launch_pack_count,
                                                pack_bool_mask)
from vllm.v1.sample.sampling_mask import MAX_COMPACT_SUPPORT, SamplingMaskTensors


def legacy_pack_sampling_mask(logits: torch.Tensor, num_sampled: torch.Tensor) -> torch.Tensor:
    """The pre-change device half: isfinite(logits) of rows that sampled as [R, ceil(V/8)] uint8."""
    return pack_bool_mask(torch.isfinite(logits) & (num_sampled > 0)[:, None])


def legacy_unpack_sampling_mask(packed_mask: np.ndarray, vocab_size: int) -> SamplingMaskLists:
    """The pre-change host half: np.unpackbits + np.nonzero over the whole [R, V] bitmask."""
    bits = np.unpackbits(packed_mask, axis=1, count=vocab_size, bitorder="little")  # [R, V] uint8
    rows, cols = np.nonzero(bits)
    offsets = np.zeros(packed_mask.shape[0] + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=packed_mask.shape[0]), out=offsets[1:])
    return SamplingMaskLists(cols.astype(np.int32), offsets, None)


def make_logits(num_reqs: int, vocab_size: int, k: int, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.full((num_reqs, vocab_size), float("-inf"), device=device)  # [num_reqs, V]
    ids = torch.randint(0, vocab_size, (num_reqs, k), device=device, generator=gen)  # [num_reqs, k]
    sizes = torch.randint(1, k + 1, (num_reqs, 1), device=device, generator=gen)  # [num_reqs, 1]
    values = torch.randn((num_reqs, k), device=device, generator=gen)
    values = torch.where(torch.arange(k, device=device)[None, :] < sizes, values, float("-inf"))
    # NOTE: duplicate ids may keep -inf; the support is "up to k" ids either way.
    return logits.scatter_(1, ids, values)


def gpu_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median milliseconds of fn() on the device (CUDA events), or wall clock on CPU."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], device: torch.device, iters: int, per_graph: int = 10) -> float:
    """Device milliseconds of one fn() with the launch overhead taken out: `per_graph` calls captured in one
    CUDA graph, replayed `iters` times between two events. Falls back to gpu_ms on CPU."""
    if device.type != "cuda":
        return gpu_ms(fn, device, iters)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (iters * per_graph)


def host_ms(fn: Callable[[], object], iters: int) -> float:
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_case(num_reqs: int, k: int, vocab_size: int, device: torch.device, iters: int,
               bandwidth_tbps: float) -> dict[str, float | int]:
    logits = make_logits(num_reqs, vocab_size, k, device, seed=num_reqs * 1000 + k)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)

    def compact_step() -> None:
        copy = SamplingMaskTensors.from_logits(logits, num_sampled, k).to_cpu_nonblocking()
        if copy.ready is not None:
            torch.cuda.current_stream(device).wait_event(copy.ready)

    copy = SamplingMaskTensors.from_logits(logits, num_sampled, k).to_cpu_nonblocking()
    copy.wait()
    lists = copy.tolists()
    num_kept = copy.tensors.token_ids.shape[1]
    counts = copy.tensors.counts.numpy()
    num_overflow = int((counts > num_kept).sum())
    compact_bytes = (num_kept + 1) * 4 * num_reqs + num_overflow * ((vocab_size + 7) // 8)

    pinned = torch.empty((num_reqs, (vocab_size + 7) // 8), dtype=torch.uint8, pin_memory=device.type == "cuda")

    def legacy_step() -> None:
        pinned.copy_(legacy_pack_sampling_mask(logits, num_sampled), non_blocking=True)

    legacy_step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    legacy_lists = legacy_unpack_sampling_mask(pinned.numpy(), vocab_size)
    assert (legacy_lists.token_ids == lists.token_ids).all() and (legacy_lists.offsets == lists.offsets).all()

    logits_bytes = num_reqs * vocab_size * 4
    return {
        "num_reqs": num_reqs, "k": k, "vocab_size": vocab_size, "max_num_kept": num_kept,
        "mean_support": float(counts.mean()), "overflow_rows": num_overflow,
        "compact_gpu_ms": gpu_ms(compact_step, device, iters),
        "compact_kernel_ms": gpu_ms(lambda: SamplingMaskTensors.from_logits(logits, num_sampled, k), device,
                                    iters),
        "compact_host_ms": host_ms(copy.tolists, iters),
        "compact_bytes": compact_bytes,
        "legacy_gpu_ms": gpu_ms(legacy_step, device, iters),
        "legacy_host_ms": host_ms(lambda: legacy_unpack_sampling_mask(pinned.numpy(), vocab_size),
                                  max(3, iters // 10)),
        "legacy_bytes": num_reqs * ((vocab_size + 7) // 8),
        "read_floor_ms": gpu_ms(lambda: logits.amax(dim=-1), device, iters),
        "kernel_graph_ms": graph_ms(lambda: SamplingMaskTensors.from_logits(logits, num_sampled, k), device, iters),
        "floor_graph_ms": graph_ms(lambda: logits.amax(dim=-1), device, iters),
        "nominal_floor_ms": logits_bytes / (bandwidth_tbps * 1e12) * 1e3,
    }


COLUMNS = [("num_reqs", "reqs", "{}"), ("k", "k", "{}"), ("mean_support", "mean |S|", "{:.1f}"),
           ("compact_gpu_ms", "compact GPU ms", "{:.3f}"), ("compact_kernel_ms", "kernel ms", "{:.3f}"),
           ("read_floor_ms", "read floor ms", "{:.3f}"), ("kernel_graph_ms", "kernel dev ms", "{:.3f}"),
           ("floor_graph_ms", "floor dev ms", "{:.3f}"), ("nominal_floor_ms", "nominal floor ms", "{:.3f}"),
           ("compact_host_ms", "tolists ms", "{:.3f}"), ("compact_bytes", "compact bytes", "{}"),
           ("legacy_gpu_ms", "legacy GPU ms", "{:.3f}"), ("legacy_host_ms", "legacy host ms", "{:.2f}"),
           ("legacy_bytes", "legacy bytes", "{}")]


def bench_tilings(num_reqs: int, k: int, vocab_size: int, device: torch.device, iters: int) -> list[dict]:
    """Device time (graph replay) of the chunked kernel under each first-launch tiling, against the read floor."""
    logits = make_logits(num_reqs, vocab_size, k, device, seed=num_reqs * 1000 + k)
    num_sampled = torch.ones(num_reqs, dtype=torch.int32, device=device)
    num_kept = min(k, vocab_size, MAX_COMPACT_SUPPORT)
    token_ids = torch.empty((num_reqs, num_kept), dtype=torch.int32, device=device)
    packed = torch.empty((num_reqs, (vocab_size + 7) // 8), dtype=torch.uint8, device=device)
    counts = torch.empty(num_reqs, dtype=torch.int32, device=device)
    floor = graph_ms(lambda: logits.amax(dim=-1), device, iters)
    rows = []
    for chunk in (1024, 2048, 4096, 8192):
        for num_warps in (2, 4, 8):
            ms = graph_ms(lambda: compact_sampling_mask_chunked(  # noqa: B023
                logits, num_sampled, token_ids, packed, counts, chunk, num_warps), device, iters)
            pack_ms = graph_ms(lambda: launch_pack_count(  # noqa: B023
                logits, num_sampled, packed, chunk, num_warps), device, iters)
            chunk_counts = launch_pack_count(logits, num_sampled, packed, chunk, num_warps)
            compact_ms = graph_ms(lambda: launch_compact(  # noqa: B023
                packed, chunk_counts, token_ids, counts, vocab_size, chunk), device, iters)
            rows.append({"num_reqs": num_reqs, "k": k, "chunk": chunk, "num_warps": num_warps,
                         "kernel_dev_ms": ms, "pack_dev_ms": pack_ms, "compact_dev_ms": compact_ms,
                         "floor_dev_ms": floor, "x_floor": ms / floor})
    return rows


def markdown_table(rows: list[dict[str, float | int]], columns: list | None = None) -> str:
    columns = columns or COLUMNS
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(fmt.format(row[key]) for key, _, fmt in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--k", type=int, nargs="+", default=[8, 220, 512])
    parser.add_argument("--vocab-size", type=int, default=151552)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--bandwidth-tbps", type=float, default=4.8, help="nominal HBM bandwidth for the floor")
    parser.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    parser.add_argument("--tilings", action="store_true", help="also compare the first launch's tilings (CUDA)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [bench_case(n, k, args.vocab_size, device, args.iters, args.bandwidth_tbps)
            for n in args.num_reqs for k in args.k]
    print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"V={args.vocab_size}, MAX_COMPACT_SUPPORT={MAX_COMPACT_SUPPORT}")
    print(markdown_table(rows))
    tilings = []
    if args.tilings and device.type == "cuda":
        tilings = [r for n in args.num_reqs if n >= 256
                   for r in bench_tilings(n, 220, args.vocab_size, device, args.iters)]
        print(markdown_table(tilings, [("num_reqs", "reqs", "{}"), ("chunk", "chunk", "{}"),
                                       ("num_warps", "warps", "{}"),
                                       ("kernel_dev_ms", "kernel dev ms", "{:.4f}"),
                                       ("pack_dev_ms", "1st launch ms", "{:.4f}"),
                                       ("compact_dev_ms", "2nd launch ms", "{:.4f}"),
                                       ("floor_dev_ms", "floor dev ms", "{:.4f}"), ("x_floor", "x floor", "{:.2f}")]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": str(device), "vocab_size": args.vocab_size, "results": rows,
                       "tilings": tilings}, f, indent=2)


if __name__ == "__main__":
    main()
