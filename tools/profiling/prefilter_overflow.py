"""How often a real checkpoint's logits would overflow the "prefilter" top-k select's buffer.

The prefilter (vllm/v1/sample/ops/topk_select.py, the CUDA default) bounds each row's k-th largest
z = logits / temperature from below by t0, the k-th largest maximum of its S-id chunks, and gathers every
z >= t0 into a buffer of `cap` slots; a row with more than `cap` such values overflows and is selected again
from its listed chunks (+~0.1 ms on an H200; ~3 ms in the radix kernel when over 2C chunks are listed). With iid
logits ~540 values are gathered at k = 512 (cap 2048); logits whose high values sit in consecutive ids gather
more. How often that happens on real models, which this project's machines do not have, this script measures
from a local Hugging Face checkpoint folder, on CPU or GPU.

For every position of every text (teacher-forced: the model's next-token logits along the text), and each
--top-k: the gathered count and whether it passes cap = max(2048, 2C), C = fast_path.num_candidates. The count
is computed here in plain torch (chunk maxima, their k-th largest, a count), independently of the kernels.

    python tools/profiling/prefilter_overflow.py --model /path/to/checkpoint [--texts FILE] [--top-k 50 512 2048]

--texts: a UTF-8 file of texts separated by blank lines (default: a few built-in English, code and Chinese
samples). Prints a table per top_k (positions, median / p99 / max gathered, overflow rate); --json-out writes it.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from vllm.v1.sample.fast_path import num_candidates
from vllm.v1.sample.metadata import SamplingMetadata

DEFAULT_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when movable metal type made it possible "
    "to reproduce books quickly and cheaply. Within a few decades presses had spread across Europe.",
    "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "机器学习是人工智能的一个分支，它研究计算机如何从数据中学习规律，并利用这些规律对未知数据进行预测。",
]
CAP = 2048


def gathered_counts(logits: torch.Tensor, temperature: float, top_k: int, chunk: int = 32) -> torch.Tensor:
    """[rows] int64: |{z >= t0}| per row (z > -inf), t0 = the top_k-th largest of the row's chunk maxima
    (-inf when there are fewer than top_k chunks), as the prefilter gathers them."""
    z = logits.float() / temperature  # [rows, V]
    rows, vocab_size = z.shape
    num_chunks = math.ceil(vocab_size / chunk)
    padded = torch.full((rows, num_chunks * chunk), float("-inf"))
    padded[:, :vocab_size] = z
    chunk_max = padded.view(rows, num_chunks, chunk).amax(dim=-1)  # [rows, NCH]
    if top_k > num_chunks:
        t0 = torch.full((rows, 1), float("-inf"))
    else:
        t0 = chunk_max.topk(top_k, dim=-1).values[:, -1:]  # [rows, 1]
    return ((z >= t0) & (z > float("-inf"))).sum(dim=-1)


def buffer_cap(top_k: int, vocab_size: int) -> int:
    md = SamplingMetadata(temperature=None, all_greedy=False, all_random=True, top_p=None, top_k=None,
                          min_p=None, generators={}, max_num_logprobs=None, max_top_k=top_k)
    return max(CAP, 2 * num_candidates(md, vocab_size))


def summarize(counts: torch.Tensor, cap: int) -> dict[str, Any]:
    c = counts.double()
    return {"positions": int(c.numel()), "median": float(c.median()), "p99": float(c.quantile(0.99)),
            "max": int(c.max()), "cap": cap, "overflow_rate": float((counts > cap).double().mean())}


def read_texts(path: str | None) -> list[str]:
    if path is None:
        return DEFAULT_TEXTS
    with open(path, encoding="utf-8") as f:
        texts = [t.strip() for t in f.read().split("\n\n")]
    return [t for t in texts if t]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="A local Hugging Face checkpoint folder.")
    parser.add_argument("--texts", default=None)
    parser.add_argument("--top-k", type=int, nargs="+", default=[50, 512, 2048])
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk", type=int, default=32, help="S, the ids behind one chunk maximum.")
    parser.add_argument("--max-tokens", type=int, default=1024, help="Tokens per text, at most.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    if min(args.top_k) < 1 or args.temperature <= 0 or args.chunk < 1:
        parser.error("--top-k and --chunk must be >= 1, --temperature > 0.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(args.device).eval()
    counts: dict[int, list[torch.Tensor]] = {k: [] for k in args.top_k}
    vocab_size = 0
    for text in read_texts(args.texts):
        ids = tokenizer(text, return_tensors="pt").input_ids[:, :args.max_tokens].to(args.device)
        with torch.no_grad():
            logits = model(ids).logits[0].cpu()  # [T, V] bf16
        vocab_size = logits.shape[1]
        for k in args.top_k:
            counts[k].append(gathered_counts(logits, args.temperature, k, args.chunk))
    results = {k: summarize(torch.cat(v), buffer_cap(k, vocab_size)) for k, v in counts.items()}
    print(f"{args.model}: V={vocab_size}, S={args.chunk}, temperature {args.temperature}")
    print("| top_k | positions | median gathered | p99 | max | cap | overflow rate |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for k, r in results.items():
        print(f"| {k} | {r['positions']} | {r['median']:.0f} | {r['p99']:.0f} | {r['max']} | {r['cap']} | "
              f"{r['overflow_rate']:.4f} |")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
