"""GPU check of the overlapped path: on CUDA (bundled model, fp32, CUDA graphs on), async scheduling on and off
give the same greedy tokens, the same seeded top-k/top-p tokens and the same sampling masks."""

from __future__ import annotations

import gc
import sys

import torch

from vllm import LLM, SamplingParams

PROMPTS = [f"Example {i}: the function" for i in range(24)]


def run(async_scheduling: bool) -> list[tuple]:
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 30, max_model_len=256, max_num_seqs=32,
              async_scheduling=async_scheduling, logprobs_mode="processed_logprobs", return_sampling_mask=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, return_sampling_mask=False)
    seeded = [SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=i, max_tokens=40 - i % 7, logprobs=1)
              for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False) + llm.generate(PROMPTS, seeded, use_tqdm=False)
    result = [(o.outputs[0].token_ids, o.outputs[0].sampling_mask.token_ids if o.outputs[0].sampling_mask else None)
              for o in outs]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> int:
    on, off = run(True), run(False)
    same = sum(a == b for a, b in zip(on, off))
    inside = all(t in m for toks, masks in on if masks for t, m in zip(toks, masks))
    print(f"async on vs off on CUDA: {same}/{len(on)} requests identical (tokens and masks); "
          f"every token inside its mask: {inside}")
    return 0 if same == len(on) and inside else 1


if __name__ == "__main__":
    sys.exit(main())
