"""Device time of steady decode steps, kernel by kernel, mask off vs on (torch.profiler, CUDA activity only).

The engine core runs at full speed (async scheduling, CUDA graphs) on the benchmark's setting (Qwen2.5-1.5B
config, dummy weights, 128-token prompts, temperature 1, top_p 0.95, top_k 512, logprobs 1, processed logprobs);
after every request has finished its prefill, `--steps` decode steps are traced. Reported per step:

- wall ms, and how much of it the device was busy (union of kernels and copies over all streams): when the
  device is busy all the time, the device step is the limit, and only device work moves throughput;
- device ms per stream (compute stream vs the output copy streams);
- the kernels (CUDA-graph kernels appear one by one), grouped into stages by name, and the top kernels,
  side by side for the two arms, so the mask's extra device work is listed kernel by kernel.

Only CUDA activity is traced (no CPU op events), so the host is not slowed down by the profiler.

    PYTHONPATH=. python3 tools/profiling/gpu_kernel_profile.py --rows 512 1024 --steps 30 [--mask-text] [--out DIR]

`--mask-text`: the mask arm also formats each mask's JSON text on the device, as under `vllm serve` (its pack and
JSON kernels in the sampler graph, the text copied to the host).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import time
from collections import defaultdict

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from vllm import LLM, SamplingParams

CONFIG = "benchmarks/configs/qwen2.5-1.5b-instruct"

# Stage of a kernel, by name (first match wins).
STAGES = [
    ("gemm", r"gemm|cutlass|nvjet|sm90_xmma|cublas|splitK"),
    ("attention", r"unified_attention|attention|reduce_segments|kv_cache|reshape_and_cache"),
    ("topk select", r"topk|radix|_count_ge|select|sort|bitonic|_chunk_max|_prefilter|_gather_above"),
    ("mask kernels", r"json|pack_rows|compact|mask_chunk|_mask"),
    ("elementwise/norm/rotary (model)", r"rms|norm|rotary|silu|act_and_mul|add|mul|copy|cat"),
]


def stage_of(name: str) -> str:
    low = name.lower()
    for stage, pattern in STAGES:
        if re.search(pattern, low):
            return stage
    return "other"


def run_arm(model: str, mask: bool, rows_list: list[int], input_len: int, steps: int) -> dict[int, dict]:
    max_rows = max(rows_list)
    output_len = steps + 64
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=max_rows,
              max_model_len=input_len + output_len + 16, logprobs_mode="processed_logprobs",
              return_sampling_mask=mask)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=output_len,
                            ignore_eos=True)
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    rng = np.random.default_rng(0)
    llm.generate([{"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()} for _ in range(8)], params,
                 use_tqdm=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    results = {}
    for rows in rows_list:
        for i in range(rows):
            engine.add_request(f"r{rows}-{i}", {"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()},
                               params)
        # Prefill every request (chunks of max_num_batched_tokens), then a few decode steps to settle.
        while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
            core.step()
        for _ in range(8):
            core.step()
        torch.cuda.synchronize()
        # NOTE: CPU activity only for a dry run without a GPU.
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                core.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        path = f"/tmp/trace_{'mask' if mask else 'nomask'}_{rows}.json"
        prof.export_chrome_trace(path)
        results[rows] = summarize(path, steps, wall)
        os.remove(path)
        while core.has_unfinished_requests():
            core.step()
        engine.output_processor.abort_requests([f"r{rows}-{i}" for i in range(rows)])
    del engine, core
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return results


def _serve_mask_text() -> None:
    """Engines made from now on format their masks' JSON text on the device, as the API server asks for
    (ModelConfig.sampling_mask_text, which `vllm serve` sets and LLM does not)."""
    from vllm.engine.arg_utils import EngineArgs
    create = EngineArgs.create_engine_config

    def create_with_text(self: EngineArgs):  # noqa: ANN202
        config = create(self)
        config.model_config.sampling_mask_text = config.model_config.return_sampling_mask
        return config

    EngineArgs.create_engine_config = create_with_text  # type: ignore[method-assign]


def summarize(trace_path: str, steps: int, wall: float) -> dict:
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    dev = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in dev)
    busy, end = 0.0, -1.0
    for s, t in intervals:
        if t <= end:
            continue
        busy += t - max(s, end)
        end = t
    per_stream: dict[str, float] = defaultdict(float)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    stages: dict[str, float] = defaultdict(float)
    copies: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in dev:
        stream = str(e.get("args", {}).get("stream", "?"))
        per_stream[stream] += e["dur"]
        name = e["name"]
        if e["cat"] == "kernel":
            k = kernels[name[:90]]
            k[0] += e["dur"]
            k[1] += 1
            stages[stage_of(name)] += e["dur"]
        else:
            kind = name.split(" ")[1] if " " in name else name
            c = copies[f"{e['cat']} {kind}"]
            c[0] += e["dur"]
            c[1] += e.get("args", {}).get("bytes", 0)
    n = steps
    return {
        "wall_ms": wall / n * 1e3,
        "busy_ms": busy / n / 1e3,
        "busy_frac": busy / 1e6 / wall,
        "streams_ms": {k: v / n / 1e3 for k, v in sorted(per_stream.items(), key=lambda kv: -kv[1])},
        "stages_ms": {k: v / n / 1e3 for k, v in sorted(stages.items(), key=lambda kv: -kv[1])},
        "kernels_us": {k: (v[0] / n, v[1] / n) for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][0])},
        "copies": {k: (v[0] / n, v[1] / n) for k, v in copies.items()},
    }


def report(off: dict, on: dict, rows: int, top: int) -> None:
    print(f"\n### {rows} rows, steady decode: ms per step (mask off / mask on)\n")
    print("| | mask off | mask on |\n|---|---:|---:|")
    print(f"| wall | {off['wall_ms']:.2f} | {on['wall_ms']:.2f} |")
    print(f"| device busy (any stream) | {off['busy_ms']:.2f} ({off['busy_frac']:.0%}) | "
          f"{on['busy_ms']:.2f} ({on['busy_frac']:.0%}) |")
    for stage in dict.fromkeys(list(off["stages_ms"]) + list(on["stages_ms"])):
        print(f"| kernels: {stage} | {off['stages_ms'].get(stage, 0):.3f} | {on['stages_ms'].get(stage, 0):.3f} |")
    for i, (a, b) in enumerate(zip(list(off["streams_ms"].items()) + [("", 0)] * 3,
                                   list(on["streams_ms"].items()) + [("", 0)] * 3)):
        if not a[0] and not b[0]:
            break
        print(f"| stream #{i} (by time; ids {a[0]} / {b[0]}) | {a[1]:.3f} | {b[1]:.3f} |")
    for kind in dict.fromkeys(list(off["copies"]) + list(on["copies"])):
        a, b = off["copies"].get(kind, (0, 0)), on["copies"].get(kind, (0, 0))
        print(f"| {kind} (us, KB) | {a[0]:.0f}, {a[1] / 1e3:.0f} | {b[0]:.0f}, {b[1] / 1e3:.0f} |")
    print(f"\nTop kernels, us per step (calls per step), mask off / mask on:\n")
    print("| kernel | off us | off calls | on us | on calls |\n|---|---:|---:|---:|---:|")
    names = list(dict.fromkeys(list(on["kernels_us"])[:top] + list(off["kernels_us"])[:top]))
    names.sort(key=lambda k: -max(off["kernels_us"].get(k, (0, 0))[0], on["kernels_us"].get(k, (0, 0))[0]))
    for name in names:
        a, b = off["kernels_us"].get(name, (0, 0)), on["kernels_us"].get(name, (0, 0))
        print(f"| `{name}` | {a[0]:.1f} | {a[1]:.1f} | {b[0]:.1f} | {b[1]:.1f} |")
    only_on = [k for k in on["kernels_us"] if k not in off["kernels_us"]]
    print(f"\nKernels only in the mask arm: {len(only_on)}, "
          f"{sum(on['kernels_us'][k][0] for k in only_on):.1f} us per step")
    for k in only_on:
        print(f"- `{k}`: {on['kernels_us'][k][0]:.1f} us, {on['kernels_us'][k][1]:.1f} calls")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--rows", type=int, nargs="+", default=[512, 1024])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", default=None, help="write the summary JSON into this folder")
    parser.add_argument("--mask-text", action="store_true", help="the mask arm with its JSON text, as when serving")
    args = parser.parse_args()
    if args.mask_text:
        _serve_mask_text()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    off = run_arm(args.model, False, args.rows, args.input_len, args.steps)
    on = run_arm(args.model, True, args.rows, args.input_len, args.steps)
    for rows in args.rows:
        report(off[rows], on[rows], rows, args.top)
    if args.out:
        with open(os.path.join(args.out, "kernel_profile.json"), "w") as f:
            json.dump({"off": off, "on": on}, f, indent=1)


if __name__ == "__main__":
    main()
