"""Offline `LLM.generate`'s host cost per step without a device: the engine in process (the default), its worker
replaced by frontend_serve.py's replay worker (one random token per row, logprobs, masks of `--mask-size` ids),
with no device time, so the step time is the host's alone: scheduler, output path, the output processor building
every request's tokens, logprobs and masks, and the garbage collector walking what piles up.

    python tools/profiling/offline_host.py --num-reqs 1024 --output-len 64 [--arms no-mask mask] [--rounds 2]

On the GPU the device step overlaps this host work only partly (synchronous here, no overlap): a host step
longer than the device's (12.5 ms at 1024 rows on the H200 for the A/B model) caps offline throughput. With
VLLM_ENABLE_V1_MULTIPROCESSING=1 the replay core runs in its own process (the engine's other mode): the step time is
then the slower of the two processes' host work, as they overlap.
Prints, per arm and round, output tokens/s, ms per step and CPU us per token (best of `--repeats` runs); each
(round, arm) runs in a fresh process, so that no arm's heap is walked by the next one's collector.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import frontend_serve  # noqa: E402


def run(num_reqs: int, output_len: int, mask: bool, mask_size: int, repeats: int, flat_logprobs: bool = False) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.v1.engine import core_client

    factory = functools.partial(frontend_serve.replay_core, device_ms=0.0, device_ms_per_row=0.0,
                                mask_size=mask_size)

    def replay_inproc(self, vllm_config):  # noqa: ANN001 - InprocClient.__init__ with the replay core
        self.engine_core = factory(vllm_config)

    def replay_mp(self, vllm_config, engine_core_factory=None, *args, **kwargs):  # noqa: ANN001 - SyncMPClient's
        original_mp(self, vllm_config, factory, *args, **kwargs)

    original_inproc, original_mp = core_client.InprocClient.__init__, core_client.SyncMPClient.__init__
    core_client.InprocClient.__init__, core_client.SyncMPClient.__init__ = replay_inproc, replay_mp
    try:
        llm = LLM(model=frontend_serve.MODEL_DIR, skip_tokenizer_init=True, max_num_seqs=num_reqs,
                  max_model_len=128 + output_len + 16, max_num_batched_tokens=num_reqs * 130,
                  logprobs_mode="processed_logprobs", return_sampling_mask=mask, device="cpu")
    finally:
        core_client.InprocClient.__init__, core_client.SyncMPClient.__init__ = original_inproc, original_mp
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=output_len,
                            ignore_eos=True, flat_logprobs=flat_logprobs)
    rng = np.random.default_rng(0)
    vocab = llm.llm_engine.vllm_config.model_config.vocab_size
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, 128).tolist()} for _ in range(num_reqs)]
    llm.generate(prompts[:8], params, use_tqdm=False)
    best = None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if mask:
            assert all(len(o.outputs[0].sampling_mask) == len(o.outputs[0].token_ids) for o in outs)
        if best is None or wall < best["wall_s"]:
            # NOTE: one step per output token (the prompts' prefill is the first token's step).
            best = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                    "multiprocess": bool(llm.llm_engine.multiprocess_mode),
                    "ms_per_step": 1e3 * wall / output_len, "cpu_us_per_token": 1e6 * cpu / tokens}
    return best


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-reqs", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--arms", nargs="+", choices=["no-mask", "mask"], default=["no-mask", "mask"])
    parser.add_argument("--rounds", type=int, default=1, help="Arms A B, then B A, ...")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mask-size", type=int, default=506)
    parser.add_argument("--flat-logprobs", action="store_true", help="SamplingParams(flat_logprobs=True)")
    parser.add_argument("--one", choices=["no-mask", "mask"], default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:  # one arm in this process: its result as JSON on the last line
        r = run(args.num_reqs, args.output_len, args.one == "mask", args.mask_size, args.repeats, args.flat_logprobs)
        print(json.dumps(r))
        return [r]
    results = []
    print("| round | arm | tokens/s | ms per step | CPU us per token |\n|---:|---|---:|---:|---:|")
    for rnd in range(args.rounds):
        for arm in args.arms if rnd % 2 == 0 else args.arms[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--one", arm, "--num-reqs", str(args.num_reqs),
                   "--output-len", str(args.output_len), "--repeats", str(args.repeats), "--mask-size",
                   str(args.mask_size), *(["--flat-logprobs"] if args.flat_logprobs else [])]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r.update(round=rnd + 1, arm=arm)
            results.append(r)
            print(f"| {rnd + 1} | {arm} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | "
                  f"{r['cpu_us_per_token']:.1f} |", flush=True)
    return results


if __name__ == "__main__":
    main()
