"""GPU acceptance of the engine issue: the Triton attention backend against the torch reference.

1. The bundled model, float32 on CUDA: greedy tokens of 16 prompts through LLM with VLLM_ATTENTION_BACKEND=TRITON
   equal those with TORCH.
2. A Qwen2.5-1.5B-config dummy model in bf16: the logits of a mixed varlen step (prefill chunks with cached
   context, and decodes) from the Triton backend agree with the torch reference within bf16 tolerance.
Prints a short report and exits non-zero on a mismatch.
"""

from __future__ import annotations

import gc
import os
import sys

import torch

from vllm import LLM, SamplingParams
from vllm.config import ModelConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.backends.torch_ref import TorchAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.attention.layer import set_attn_backend

PROMPTS = ["The function", "A module is", "In Python, a list", "Return the", "class", "import os\n",
           "The default value of", "Raises an exception", "An integer", "The string", "If the", "for each",
           "Lists are", "Note that", "This is", "Example:"]


def bundled_greedy(backend: str) -> list[list[int]]:
    os.environ["VLLM_ATTENTION_BACKEND"] = backend
    llm = LLM(device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 30, max_model_len=512)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return [o.outputs[0].token_ids for o in outs]


def qwen_logits_check() -> float:
    cfg = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs", "qwen2.5-1.5b-instruct")
    mc = ModelConfig(model=cfg, load_format="dummy", max_model_len=4096)
    dev = torch.device("cuda")
    model = get_model(mc, dev, torch.bfloat16)
    g = torch.Generator(device="cpu").manual_seed(0)
    # Requests: (cached context, new tokens). Decodes with long contexts and prefill chunks.
    reqs = [(0, 128), (300, 1), (1000, 1), (64, 37), (0, 1), (511, 1), (200, 200), (17, 1)]
    bs = 16
    blocks_per = [-(-(c + n) // bs) for c, n in reqs]
    perm = torch.randperm(sum(blocks_per), generator=g).int()
    table = torch.zeros(len(reqs), max(blocks_per), dtype=torch.int32)
    o = 0
    for i, nb in enumerate(blocks_per):
        table[i, :nb] = perm[o:o + nb]
        o += nb
    vocab = mc.vocab_size
    # Fill the cache for the cached context with a prefill through the torch backend, then run the step.
    def run(backend, kv, ctx_only: bool) -> torch.Tensor:
        set_attn_backend(model, backend)
        ids, pos, slots, qsl, sl = [], [], [], [0], []
        for i, (c, n) in enumerate(reqs):
            lo, hi = (0, c) if ctx_only else (c, c + n)
            p = torch.arange(lo, hi)
            pos.append(p)
            ids.append(torch.randint(0, vocab, (hi - lo,), generator=torch.Generator().manual_seed(i * 7 + lo)))
            slots.append(table[i, p // bs].long() * bs + p % bs)
            qsl.append(qsl[-1] + hi - lo)
            sl.append(hi)
        qsl_t, sl_t = torch.tensor(qsl, dtype=torch.int32), torch.tensor(sl, dtype=torch.int32)
        q_lens = qsl_t[1:] - qsl_t[:-1]
        md = AttentionMetadata(
            num_actual_tokens=int(qsl[-1]), num_reqs=len(reqs), max_query_len=int(q_lens.max()),
            max_seq_len=int(sl_t.max()), query_start_loc=qsl_t.to(dev), seq_lens=sl_t.to(dev),
            block_table=table.to(dev), slot_mapping=torch.cat(slots).to(dev), query_start_loc_cpu=qsl_t,
            seq_lens_cpu=sl_t)
        with torch.inference_mode(), set_forward_context(md, kv):
            hidden = model(torch.cat(ids).to(dev), torch.cat(pos).to(dev))
            last = (qsl_t[1:] - 1).clamp(min=0).to(dev)
            return model.compute_logits(hidden[last]).float()
    shape = (2, int(perm.numel()), bs, mc.num_kv_heads, mc.head_size)
    kv = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(mc.num_layers)]
    run(TorchAttentionBackend(), kv, ctx_only=True)
    kv2 = [t.clone() for t in kv]
    ref = run(TorchAttentionBackend(), kv, ctx_only=False)
    tri = run(TritonAttentionBackend(), kv2, ctx_only=False)
    rel = ((tri - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()
    top_agree = (tri.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"qwen2.5-1.5b dummy bf16: max relative L2 error of logits {rel:.2e}, argmax agreement {top_agree:.2f}")
    return rel


def main() -> int:
    ok = True
    tri, ref = bundled_greedy("TRITON"), bundled_greedy("TORCH")
    same = sum(a == b for a, b in zip(tri, ref))
    print(f"bundled model fp32 greedy, 16 prompts x 48 tokens: {same}/16 identical (TRITON vs TORCH)")
    ok &= same == 16
    os.environ.pop("VLLM_ATTENTION_BACKEND", None)
    rel = qwen_logits_check()
    ok &= rel < 2e-2
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
