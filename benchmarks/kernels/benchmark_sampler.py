"""GPU time of Sampler.forward: the fast top-k path vs the general full-vocabulary path, mask on and off.

Setting (the serving benchmark's): every row temperature=1, top_p=0.95, top_k=512, logprobs=1,
processed_logprobs; V=151936 fp32 logits; num_reqs in {64, 256, 512, 1024}. References in the same table:
torch.topk(k=513) and one read of the logits (`logits.amax(-1)`).

Floor (bytes moved / 4.8 TB/s HBM on one H200; one fp32 read of the logits is R x 151936 x 4 bytes):

| num_reqs | one read (MB) | floor of any sampler (1 read) | radix select as built (4 reads) |
|---|---|---|---|
| 64 | 38.9 | 8.1 us | 32 us |
| 256 | 155.6 | 32 us | 130 us |
| 512 | 311.2 | 65 us | 259 us |
| 1024 | 622.3 | 130 us | 519 us |

Everything after the select works on [R, C] candidates (C = 640 for top_k=512: 1.3-2.6 MB), well under the
read. The mask's own cost on the fast path is a scatter over [R, C] and the [R, K] int32 copy.

Usage: python benchmarks/kernels/benchmark_sampler.py [--out results.json] [--iters 50]
"""

from __future__ import annotations

import argparse
import json

import torch

from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

VOCAB_SIZE = 151936
NUM_REQS = (64, 256, 512, 1024)


def make_metadata(num_reqs: int, mask: bool, device: torch.device) -> SamplingMetadata:
    return SamplingMetadata(
        temperature=torch.ones(num_reqs, device=device), all_greedy=False, all_random=True,
        top_p=torch.full((num_reqs,), 0.95, device=device),
        top_k=torch.full((num_reqs,), 512, dtype=torch.int32, device=device), min_p=None, generators={},
        max_num_logprobs=1, max_top_k=512,
        sampling_mask_rows=torch.ones(num_reqs, dtype=torch.int32, device=device) if mask else None)


def time_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmark_sampler.py needs a CUDA device")
    device = torch.device("cuda")
    fast, general = Sampler("processed_logprobs"), Sampler("processed_logprobs", use_fast_path=False)
    rows = []
    for num_reqs in NUM_REQS:
        gen = torch.Generator(device=device).manual_seed(0)
        logits = (torch.randn(num_reqs, VOCAB_SIZE, device=device, generator=gen) * 3).to(torch.bfloat16).float()
        row = {"num_reqs": num_reqs,
               "read_ms": time_ms(lambda: logits.amax(dim=-1), args.iters),
               "topk513_ms": time_ms(lambda: logits.topk(513, dim=-1), args.iters)}
        for name, sampler in (("fast", fast), ("general", general)):
            for mask in (False, True):
                md = make_metadata(num_reqs, mask, device)

                def step(sampler: Sampler = sampler, md: SamplingMetadata = md) -> None:
                    out = sampler(logits, md)
                    if out.sampling_mask is not None:
                        out.sampling_mask.to_cpu_nonblocking()

                row[f"{name}_{'mask' if mask else 'nomask'}_ms"] = time_ms(step, args.iters)
        rows.append(row)
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) if k == "num_reqs" else f"{row[k]:.3f}" for k in keys) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"vocab_size": VOCAB_SIZE, "device": torch.cuda.get_device_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
