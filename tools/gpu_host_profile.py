"""Host-side profile of the offline engine at full speed (async scheduling, CUDA graphs): where the main
thread's time goes per step, with cProfile, for mask off and on.

`wait for step output` (AsyncModelRunnerOutput.get_output) is the time the main thread waits for the device
and the output thread; everything else is host work on the step's critical path.

    PYTHONPATH=. python3 tools/gpu_host_profile.py --num-prompts 512 --output-len 64
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import time

import numpy as np
import torch

from vllm import LLM, SamplingParams

CONFIG = "benchmarks/configs/qwen2.5-1.5b-instruct"
KEYS = ["get_output", "schedule", "update_from_output", "process_outputs", "execute_model_async", "prepare",
        "_sampling_metadata", "_finish_step", "forward", "submit", "replay", "compute_logits"]


def run(model: str, mask: bool, num_prompts: int, input_len: int, output_len: int, top: int) -> None:
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=num_prompts,
              max_model_len=input_len + output_len + 16, logprobs_mode="processed_logprobs",
              return_sampling_mask=mask)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=output_len,
                            ignore_eos=True)
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()} for _ in range(num_prompts)]
    llm.generate(prompts[:8], params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm at full size
    prof = cProfile.Profile()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = output_len + 1
    print(f"\n##### mask={'on' if mask else 'off'}: {num_prompts} x {output_len} tokens in {wall:.2f} s "
          f"(cProfile on), {num_prompts * output_len / wall:,.0f} tok/s, ~{wall / steps * 1e3:.1f} ms/step")
    stats = pstats.Stats(prof)
    rows = []
    for (path, line, name), (cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
        if name in KEYS and "vllm" in path:
            rows.append((ct / steps * 1e3, name, path.split("vllm/")[-1], nc))
    print("| function | ms/step (cumulative) | calls |\n|---|---:|---:|")
    for ms, name, path, nc in sorted(rows, reverse=True):
        print(f"| {path}:{name} | {ms:.2f} | {nc} |")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue()[-9000:])
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--top", type=int, default=35)
    parser.add_argument("--mask", choices=["off", "on", "both"], default="both")
    args = parser.parse_args()
    for mask in ([False, True] if args.mask == "both" else [args.mask == "on"]):
        run(args.model, mask, args.num_prompts, args.input_len, args.output_len, args.top)


if __name__ == "__main__":
    main()
