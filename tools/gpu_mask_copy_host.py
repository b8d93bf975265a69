"""Host time of the mask's device-to-host copy on CUDA, piece by piece (the engine's `launch.mask` and the
output thread's mask lists), to tell which part of the mask arm's host work a change of the copy layout can
remove. Needs a GPU; no model.

A prepacked mask with JSON text and API-server groups (what the sampler's CUDA graph hands the async output
copier in serving), rows x K int32 ids with `--count` kept per row:
- `to_cpu_nonblocking`: the whole call as `AsyncOutputCopier.submit` makes it (lending staging slot);
- its pieces, each timed alone in a loop: `wait_stream`, entering/leaving `torch.cuda.stream`, one
  `HostStagingSlot.copy` of a small and of a large buffer, `record_stream`, an event record;
- `lists`: `tolists()` + `text_lists()` once the copy is done (the output thread's share).

    PYTHONPATH=. python3 tools/gpu_mask_copy_host.py --rows 256 1024 [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np
import torch

from vllm.v1.host_staging import HostStagingSlot, copy_stream
from vllm.v1.sample.sampling_mask import SamplingMaskTensors


def per_call_us(fn: Callable[[], object], n: int = 300) -> float:
    """Median host microseconds of `fn()` over n calls (after 20 warm-up calls)."""
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return float(np.median(times)) * 1e6


def make_mask(rows: int, k: int, count: int, vocab: int, clients: int) -> SamplingMaskTensors:
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.sort(torch.randint(0, vocab, (rows, k), device="cuda", generator=g, dtype=torch.int32), dim=1)[0]
    counts = torch.full((rows,), count, dtype=torch.int32, device="cuda")
    packed = torch.zeros(rows, (vocab + 7) // 8, dtype=torch.uint8, device="cuda")
    group = torch.arange(rows, device="cuda", dtype=torch.int32) % clients
    return SamplingMaskTensors(ids, packed, counts, vocab).prepack(with_text=True, group=group)


def measure(rows: int, k: int, count: int, vocab: int, clients: int) -> dict[str, float]:
    mask = make_mask(rows, k, count, vocab, clients)
    slot = HostStagingSlot(lends=True)
    stream = copy_stream(mask.counts.device)
    compute = torch.cuda.current_stream()
    result: dict[str, float] = {"rows": rows}

    def whole() -> object:
        copy = mask.to_cpu_nonblocking(with_text=True, staging=slot)
        copy.wait()
        return copy

    # NOTE: each call waits for its copy (outside the timed part below), so the slot is free again.
    times = []
    for i in range(320):
        t0 = time.perf_counter()
        copy = mask.to_cpu_nonblocking(with_text=True, staging=slot)
        t1 = time.perf_counter()
        copy.wait()
        if i >= 20:
            times.append(t1 - t0)
    result["to_cpu_nonblocking"] = float(np.median(times)) * 1e6
    copy = whole()
    result["lists (tolists + text_lists)"] = per_call_us(lambda: copy.text_lists(copy.tolists()), 100)
    result["wait_stream"] = per_call_us(lambda: stream.wait_stream(compute))

    def enter_leave() -> None:
        with torch.cuda.stream(stream):
            pass

    result["with torch.cuda.stream"] = per_call_us(enter_leave)
    small, large = mask.counts, mask.packed_ids
    assert large is not None and mask.text is not None
    with torch.cuda.stream(stream):
        result["slot.copy counts"] = per_call_us(lambda: slot.copy(small, "counts"))
        result["slot.copy ids"] = per_call_us(lambda: slot.copy(large, "ids"))
        result["slot.copy text"] = per_call_us(lambda: slot.copy(mask.text, "text"))
        event = torch.cuda.Event()
        result["event.record"] = per_call_us(lambda: event.record(stream))
    result["record_stream"] = per_call_us(lambda: mask.counts.record_stream(stream))
    torch.cuda.synchronize()
    result["ids MB"] = large.numel() * 4 / 1e6
    result["text MB"] = mask.text.numel() / 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--k", type=int, default=512)
    parser.add_argument("--count", type=int, default=40, help="ids kept per row (top_p trims top_k's 512)")
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    results = [measure(r, args.k, args.count, args.vocab, args.clients) for r in args.rows]
    keys = [k for k in results[0] if k != "rows"]
    print("| us per call (median) | " + " | ".join(f"{r['rows']} rows" for r in results) + " |")
    print("|---|" + "---:|" * len(results))
    for key in keys:
        print(f"| {key} | " + " | ".join(f"{r[key]:.1f}" for r in results) + " |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
