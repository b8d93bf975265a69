"""Where the step time goes on the GPU, for mask off and mask on (offline engine, Qwen2.5-1.5B config, dummy
weights, top_k 512 top_p 0.95 logprobs 1).

Default: a per-stage profile with synchronous scheduling (so the stages do not overlap), each stage wrapped
with sync() + perf_counter: schedule, input preparation, forward (CUDA-graph replay for decode), logits,
sampler, output copy/lists, update_from_output and the frontend's output processing; mean ms per decode step.

--cprofile: the engine at full speed (async scheduling, CUDA graphs) under cProfile instead: the main thread's
cumulative ms per step in the engine's functions, then the top functions by own time. `get_output` is the time
the main thread waits for the device and the output thread; everything else is host work on the critical path.

    PYTHONPATH=. python3 tools/gpu_profile_step.py --num-prompts 512 --output-len 64 [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import pstats
import time
from collections import defaultdict

import numpy as np
import torch

from vllm import LLM, SamplingParams

CONFIG = "benchmarks/configs/qwen2.5-1.5b-instruct"
# Engine functions reported by --cprofile.
KEYS = ["get_output", "schedule", "update_from_output", "process_outputs", "execute_model_async", "prepare",
        "_sampling_metadata", "_finish_step", "forward", "submit", "replay", "compute_logits"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def instrument(obj: object, name: str, stage: str, times: dict[str, list[float]],
               decode_flags: list[bool] | None = None) -> None:
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        sync()
        times[stage].append(time.perf_counter() - t0)
        if decode_flags is not None:
            decode_flags.append(out.total_num_scheduled_tokens == len(out.num_scheduled_tokens))
        return out

    setattr(obj, name, timed)


def make_run(model: str, mask: bool, num_prompts: int, input_len: int, output_len: int,
             async_scheduling: bool | None) -> tuple[LLM, list[dict], SamplingParams]:
    """The engine, N random-token prompts and the benchmark's sampling settings."""
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, max_num_seqs=num_prompts,
              max_model_len=input_len + output_len + 16, logprobs_mode="processed_logprobs",
              return_sampling_mask=mask, async_scheduling=async_scheduling)
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=output_len,
                            ignore_eos=True)
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, input_len).tolist()} for _ in range(num_prompts)]
    return llm, prompts, params


def release(llm: LLM) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profile(model: str, mask: bool, num_prompts: int, input_len: int, output_len: int) -> dict[str, float]:
    llm, prompts, params = make_run(model, mask, num_prompts, input_len, output_len, async_scheduling=False)
    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    runner = core.worker.model_runner
    times: dict[str, list[float]] = defaultdict(list)
    decode: list[bool] = []
    instrument(core.scheduler, "schedule", "schedule", times, decode)
    instrument(runner.input_buffers, "prepare", "prepare inputs", times)
    instrument(runner, "_forward", "forward", times)
    instrument(runner.model, "compute_logits", "logits", times)
    instrument(runner, "sampler", "sampler", times)
    instrument(runner, "_finish_step", "output copy submit", times)
    instrument(core.scheduler, "update_from_output", "update_from_output", times)
    instrument(engine.output_processor, "process_outputs", "output processor", times)
    llm.generate(prompts[:8], params, use_tqdm=False)
    times.clear()
    decode.clear()
    sync()
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t0
    # NOTE: every stage runs once per step (synchronous scheduling); the means are over decode-only steps.
    num_steps = len(decode)
    is_decode = np.array(decode)
    result = {k: float(np.mean(np.array(v[:num_steps])[is_decode[:len(v)]])) * 1e3 for k, v in times.items()}
    result["steps"] = num_steps
    result["decode steps"] = int(is_decode.sum())
    result["wall per step"] = wall / num_steps * 1e3
    result["output tok/s"] = num_prompts * output_len / wall
    del engine, core, runner
    release(llm)
    return result


def cprofile_run(model: str, mask: bool, num_prompts: int, input_len: int, output_len: int, top: int) -> None:
    llm, prompts, params = make_run(model, mask, num_prompts, input_len, output_len, async_scheduling=None)
    llm.generate(prompts[:8], params, use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)  # warm at full size
    prof = cProfile.Profile()
    sync()
    t0 = time.perf_counter()
    prof.enable()
    llm.generate(prompts, params, use_tqdm=False)
    prof.disable()
    wall = time.perf_counter() - t0
    steps = output_len + 1
    print(f"\n##### mask={'on' if mask else 'off'}: {num_prompts} x {output_len} tokens in {wall:.2f} s "
          f"(cProfile on), {num_prompts * output_len / wall:,.0f} tok/s, ~{wall / steps * 1e3:.1f} ms/step")
    rows = []
    for (path, _line, name), (_cc, nc, _tt, ct, _callers) in pstats.Stats(prof).stats.items():  # type: ignore
        if name in KEYS and "vllm" in path:
            rows.append((ct / steps * 1e3, name, path.split("vllm/")[-1], nc))
    print("| function | ms/step (cumulative) | calls |\n|---|---:|---:|")
    for ms, name, path, nc in sorted(rows, reverse=True):
        print(f"| {path}:{name} | {ms:.2f} | {nc} |")
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(out.getvalue()[-9000:])
    release(llm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--cprofile", action="store_true", help="full-speed engine under cProfile instead")
    parser.add_argument("--top", type=int, default=35, help="--cprofile: functions listed by own time")
    args = parser.parse_args()
    if args.cprofile:
        for mask in (False, True):
            cprofile_run(args.model, mask, args.num_prompts, args.input_len, args.output_len, args.top)
        return
    off = profile(args.model, False, args.num_prompts, args.input_len, args.output_len)
    on = profile(args.model, True, args.num_prompts, args.input_len, args.output_len)
    print(f"batch {args.num_prompts}, {args.output_len} output tokens, synchronous steps, ms per decode step "
          "(mean); wall per step and tok/s over the whole run")
    print("| stage | mask off | mask on |\n|---|---:|---:|")
    for key in off:
        print(f"| {key} | {off[key]:.3f} | {on.get(key, float('nan')):.3f} |")


if __name__ == "__main__":
    main()
