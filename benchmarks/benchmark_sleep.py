"""Sleep mode on a GPU (docs/rl.md, "Sleep mode"): memory held awake and asleep, sleep and wake times, outputs and
throughput before and after a wake, and whether any CUDA graph was captured again.

    python benchmarks/benchmark_sleep.py --model benchmarks/configs/qwen2.5-1.5b-instruct --json-out sleep.json

The engine runs in this process (LLM, engine core in process) with dummy weights, gpu_memory_utilization 0.9.
Memory is the device's used memory as nvidia-smi reports it (this process is the only user), minus what was
used before the engine started; `torch.cuda.mem_get_info` gives the same device-wide figure. Each level is
timed --rounds times (sleep, then wake_up of both tags); level 2 wakes the weights, then the KV cache (its
weights are then undefined, as after vLLM's level 2: a trainer's update follows; nothing is generated after it).
The first level-1 sleep is reported on its own ("first_sleep_s"): the weights' pinned host backup is allocated at
start-up, so it should take as long as the later ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

import torch

from vllm import LLM, SamplingParams


def used_mib() -> float:
    """The device's used memory (MiB), from nvidia-smi when it answers, else torch.cuda.mem_get_info."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(torch.cuda.current_device())], capture_output=True, text=True, timeout=20)
        return float(out.stdout.strip().splitlines()[0])
    except Exception:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / (1 << 20)


def graph_ids(runner: Any) -> dict[str, int]:
    ids = {f"decode{s}": id(g) for s, g in runner.cudagraphs.graphs.items()}
    ids.update({f"mixed{s}": id(g) for s, g in runner.mixed_graphs.graphs.items()})
    return ids


def throughput(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list[list[int]]]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="benchmarks/configs/qwen2.5-1.5b-instruct")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    torch.cuda.init()
    base = used_mib()
    llm = LLM(args.model, load_format="dummy", skip_tokenizer_init=True, enable_sleep_mode=True,
              gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=256)
    worker = llm.llm_engine.engine_core.engine_core.worker
    runner, sleeper = worker.model_runner, worker.sleeper
    rng = torch.Generator().manual_seed(0)
    vocab = runner.vocab_size
    prompts = [{"prompt_token_ids": torch.randint(0, vocab, (args.input_len,), generator=rng).tolist()}
               for _ in range(args.num_prompts)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

    throughput(llm, prompts[:16], greedy)  # warm-up (the sampler graphs of these settings)
    tput_before, out_before = throughput(llm, prompts, greedy)
    graphs_before = graph_ids(runner)
    awake = used_mib() - base
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "model": args.model,
        "weights_gib": sleeper.weights.nbytes / (1 << 30), "kv_cache_gib": sleeper.kv_cache.nbytes / (1 << 30),
        "held_awake_mib": awake, "throughput_before_tok_s": tput_before}
    for level in (1, 2):
        sleeps, wakes, asleep = [], [], []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.sleep(level=level)
            sleeps.append(time.perf_counter() - t0)
            asleep.append(used_mib() - base)
            t0 = time.perf_counter()
            if level == 1:
                llm.wake_up()
            else:
                llm.wake_up(tags=["weights"])
                wakes_weights = time.perf_counter() - t0
                llm.wake_up(tags=["kv_cache"])
            wakes.append(time.perf_counter() - t0)
        result[f"level{level}"] = {"sleep_s": sleeps, "wake_s": wakes, "held_asleep_mib": asleep,
                                   "held_asleep_fraction": max(asleep) / awake,
                                   "sleep_s_median": statistics.median(sleeps),
                                   "wake_s_median": statistics.median(wakes), "first_sleep_s": sleeps[0]}
        if level == 2:
            result["level2"]["wake_weights_only_s_last"] = wakes_weights
        if level == 1:
            tput_after, out_after = throughput(llm, prompts, greedy)
            result["level1"]["outputs_identical"] = out_after == out_before
            result["level1"]["throughput_after_tok_s"] = tput_after
            result["level1"]["graphs_unchanged"] = graph_ids(runner) == graphs_before
    print(json.dumps(result, indent=2))
    l1 = result["level1"]
    print(f"| {result['device']} | weights {result['weights_gib']:.2f} GiB, KV {result['kv_cache_gib']:.2f} GiB | "
          f"held awake {awake / 1024:.2f} GiB, asleep {max(l1['held_asleep_mib']) / 1024:.2f} GiB "
          f"({100 * l1['held_asleep_fraction']:.1f}%) | level 1 sleep {l1['sleep_s_median']:.3f} s (first "
          f"{l1['first_sleep_s']:.3f} s), wake "
          f"{l1['wake_s_median']:.3f} s | level 2 sleep {result['level2']['sleep_s_median']:.3f} s, wake "
          f"{result['level2']['wake_s_median']:.3f} s | {tput_before:.0f} -> {l1['throughput_after_tok_s']:.0f} "
          f"tok/s | outputs identical {l1['outputs_identical']} | graphs unchanged {l1['graphs_unchanged']} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
