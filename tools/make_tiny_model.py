"""Generate the bundled tiny model, vllm/assets/tiny-llama: the default whenever no model is named.

Trains, on CPU and offline, a byte-level BPE tokenizer and a two-layer Llama (GQA, tied embeddings) on
English text shipped with the Python interpreter (`pydoc_data.topics` and stdlib docstrings), then writes a
Hugging Face folder: config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json.

Invariants:
- Deterministic: fixed seeds, 2 CPU threads, deterministic algorithms, a fixed step count and a corpus
  built in sorted order; the same Python, torch and tokenizers versions give byte-identical files.
- The weights use Hugging Face Llama names; lm_head.weight is absent because the embeddings are tied.
- The tokenizer round-trips text: decode(encode(s)) == s for any UTF-8 string (byte-level, no normalizer).
- transformers is needed only by `verify`, which loads the folder back and checks it against this model.

Usage: python tools/make_tiny_model.py [--out DIR] [--steps N] [--no-verify]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import math
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

SEED = 0
# NOTE: one thread: on the shared 2-core machine two OpenMP threads ran 2-3x slower than one (spin waits
# under oversubscription), and one thread gives the same floats whatever the machine's core count.
NUM_THREADS = 1
BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0, 1, 2, 3

CONFIG: dict[str, object] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "use_cache": True,
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# NOTE: pure-Python or long-stable modules, so the docstrings do not depend on the build of the interpreter.
DOC_MODULES = (
    "builtins collections functools itertools os posixpath re json string textwrap argparse logging pathlib "
    "shutil subprocess threading queue heapq bisect random statistics math datetime calendar decimal fractions "
    "typing dataclasses enum inspect io csv difflib pprint abc contextlib copy pickle socket zipfile tarfile "
    "urllib.parse http.client email.message unittest.case asyncio.tasks sqlite3"
).split()

SEQ_LEN = 128
BATCH_SIZE = 8
LR = 3e-3
WARMUP_STEPS = 30
DEFAULT_STEPS = 450


def collect_corpus() -> tuple[list[str], list[tuple[str, str]]]:
    """Documents (pydoc topics, then docstrings) and (question, answer) pairs for chat-format examples."""
    import pydoc_data.topics

    docs: list[str] = []
    pairs: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(name: str, text: str | None) -> None:
        if not text or len(text) < 80 or text in seen:
            return
        seen.add(text)
        docs.append(text)
        answer = text.split("\n\n")[0].strip()
        if 40 <= len(answer) <= 600:
            pairs.append((f"What is {name}?", answer))

    topics: dict[str, str] = pydoc_data.topics.topics
    for key in sorted(topics):
        add(key, topics[key].strip())
    for mod_name in DOC_MODULES:
        mod = importlib.import_module(mod_name)
        add(mod_name, inspect.getdoc(mod))
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if not (inspect.isclass(obj) or inspect.isroutine(obj)):
                continue
            add(f"{mod_name}.{attr}", inspect.getdoc(obj))
            if inspect.isclass(obj):
                for meth in sorted(vars(obj)):
                    member = vars(obj)[meth]
                    if not meth.startswith("_") and inspect.isroutine(member):
                        add(f"{mod_name}.{attr}.{meth}", inspect.getdoc(member))
    return docs, pairs


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, expected {vocab_size}")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise RuntimeError(f"special token {name} has id {tok.token_to_id(name)}, expected {i}")
    return tok


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    import jinja2

    return jinja2.Environment().from_string(CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt)


def build_token_stream(tok: Tokenizer, docs: list[str], pairs: list[tuple[str, str]]) -> torch.Tensor:
    """One flat stream: `<s> doc </s>` per document, then `<s> chat </s>` per question/answer pair."""
    texts = list(docs)
    for q, a in pairs:
        texts.append(render_chat([{"role": "user", "content": q}, {"role": "assistant", "content": a}], False))
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.append(0)
        ids.extend(enc.ids)
        ids.append(1)
    return torch.tensor(ids, dtype=torch.int64)  # [num_tokens] int64


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__()
        h, d = int(cfg["hidden_size"]), int(cfg["head_dim"])
        self.num_heads, self.num_kv_heads, self.head_dim = int(cfg["num_attention_heads"]), int(
            cfg["num_key_value_heads"]), d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, nh, T, d]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, nkv, T, d]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # NOTE: kv head j serves query heads j*rep .. (j+1)*rep-1, as in HF's repeat_kv.
        rep = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, nh, T, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__()
        h, i = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__()
        eps = float(cfg["rms_norm_eps"])
        self.input_layernorm = RMSNorm(int(cfg["hidden_size"]), eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(int(cfg["hidden_size"]), eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(int(cfg["vocab_size"]), int(cfg["hidden_size"]))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(int(cfg["num_hidden_layers"])))
        self.norm = RMSNorm(int(cfg["hidden_size"]), float(cfg["rms_norm_eps"]))


class TinyLlama(nn.Module):
    """Llama with tied embeddings; state_dict keys are the Hugging Face checkpoint names."""

    def __init__(self, cfg: dict[str, object]) -> None:
        super().__init__()
        self.model = LlamaBackbone(cfg)
        d = int(cfg["head_dim"])
        inv_freq = 1.0 / (float(cfg["rope_theta"]) ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [d / 2] float32
        std = float(cfg["initializer_range"])
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # NOTE: GPT-2 style scaling of the projections that write into the residual stream.
                scale = 1.0 / math.sqrt(2 * int(cfg["num_hidden_layers"])) if name.endswith(
                    ("o_proj.weight", "down_proj.weight")) else 1.0
                nn.init.normal_(p, mean=0.0, std=std * scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        pos = torch.arange(t, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # [T, d / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, d]
        cos, sin = emb.cos(), emb.sin()
        x = self.model.embed_tokens(input_ids)  # [B, T, H]
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.t()  # [B, T, V]


def train(model: TinyLlama, stream: torch.Tensor, steps: int) -> None:
    gen = torch.Generator().manual_seed(SEED)
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95))
    offsets = torch.arange(SEQ_LEN + 1)
    t0 = time.perf_counter()
    for step in range(steps):
        lr = LR * min(1.0, (step + 1) / WARMUP_STEPS)
        if step >= WARMUP_STEPS:
            frac = (step - WARMUP_STEPS) / max(1, steps - WARMUP_STEPS)
            lr = LR * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
        batch = stream[starts[:, None] + offsets]  # [B, SEQ_LEN + 1] int64
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"  step {step:4d}/{steps}  loss {loss.item():.3f}  lr {lr:.2e}  "
                  f"{time.perf_counter() - t0:6.1f}s", flush=True)


@torch.no_grad()
def greedy(model: TinyLlama, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(model(torch.tensor([out]))[0, -1].argmax()))
    return out[len(ids):]


def save(out_dir: str, model: TinyLlama, tok: Tokenizer) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    weights_path = os.path.join(out_dir, "model.safetensors")
    save_file(tensors, weights_path, metadata={"format": "pt"})
    os.chmod(weights_path, 0o644)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    gen_cfg = {"bos_token_id": CONFIG["bos_token_id"], "eos_token_id": CONFIG["eos_token_id"],
               "pad_token_id": CONFIG["eos_token_id"]}
    for name, obj in (("config.json", CONFIG), ("tokenizer_config.json", tok_cfg),
                      ("generation_config.json", gen_cfg)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2)
            f.write("\n")


def verify(out_dir: str, model: TinyLlama, tok: Tokenizer) -> None:
    """Load the folder with transformers and check it against the model and tokenizer just trained."""
    try:
        from transformers import AutoTokenizer, LlamaForCausalLM
    except ImportError:
        print("transformers not installed: skipping verification")
        return
    hf = LlamaForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out_dir)
    ids = tok.encode("The function returns the value of the argument.").ids
    with torch.no_grad():
        diff = (hf(torch.tensor([ids])).logits - model(torch.tensor([ids]))).abs().max().item()
    print(f"max |logits(HF) - logits(script)| = {diff:.2e}")
    if diff > 1e-3:
        raise RuntimeError("transformers' LlamaForCausalLM disagrees with the trained model")
    for s in ("The function", "Hello,  world!\n\tTabs & ünïcödé — 日本語 🙂", " leading space", ""):
        if hf_tok(s)["input_ids"] != tok.encode(s).ids:
            raise RuntimeError(f"HF and tokenizers encodings differ for {s!r}")
        if tok.decode(tok.encode(s).ids) != s or hf_tok.decode(hf_tok(s)["input_ids"], skip_special_tokens=True) != s:
            raise RuntimeError(f"round trip failed for {s!r}")
    prompt = hf_tok("The function", return_tensors="pt")
    out = hf.generate(**prompt, max_new_tokens=30, do_sample=False)
    new_ids = out[0, prompt["input_ids"].shape[1]:].tolist()
    if new_ids != greedy(model, prompt["input_ids"][0].tolist(), 30):
        raise RuntimeError("HF greedy generation differs from the script's")
    print(f"greedy 30 tokens after 'The function': {hf_tok.decode(new_ids)!r}")
    msgs = [{"role": "user", "content": "What is a list?"}]
    chat = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    print(f"chat template, one message: {chat!r}")
    chat_ids = hf_tok(chat, add_special_tokens=False, return_tensors="pt")
    out = hf.generate(**chat_ids, max_new_tokens=40, do_sample=False)
    print(f"chat reply: {hf_tok.decode(out[0, chat_ids['input_ids'].shape[1]:], skip_special_tokens=False)!r}")


def main() -> None:
    default_out = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                               "vllm", "assets", "tiny-llama")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=default_out, help="output folder")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="training steps")
    parser.add_argument("--no-verify", action="store_true", help="skip the transformers check")
    args = parser.parse_args()

    t_start = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)

    docs, pairs = collect_corpus()
    text_sha = hashlib.sha256("\x00".join(docs).encode()).hexdigest()[:16]
    print(f"corpus: {len(docs)} documents, {sum(map(len, docs))} chars, {len(pairs)} chat pairs, "
          f"sha256 {text_sha}")
    tok = train_tokenizer(docs, int(CONFIG["vocab_size"]))
    stream = build_token_stream(tok, docs, pairs)
    print(f"tokenizer: {tok.get_vocab_size()} tokens; stream: {stream.numel()} tokens "
          f"({time.perf_counter() - t_start:.1f}s)")

    model = TinyLlama(CONFIG)
    print(f"model: {sum(p.numel() for p in model.parameters())} parameters; training {args.steps} steps "
          f"of {BATCH_SIZE}x{SEQ_LEN} tokens")
    train(model, stream, args.steps)
    model.eval()
    save(args.out, model, tok)
    size = sum(os.path.getsize(os.path.join(args.out, f)) for f in os.listdir(args.out))
    print(f"wrote {args.out} ({size / 1e6:.2f} MB); model.safetensors sha256 "
          f"{hashlib.sha256(open(os.path.join(args.out, 'model.safetensors'), 'rb').read()).hexdigest()[:16]}")
    print(f"generation time: {time.perf_counter() - t_start:.1f}s")
    if not args.no_verify:
        verify(args.out, model, tok)
    print(f"total runtime: {time.perf_counter() - t_start:.1f}s")


if __name__ == "__main__":
    main()
