"""What benchmarks/benchmark_serving.py measures: a request's record (RequestRecord) built from the SSE events
of its stream, one level's metrics from its records (summarize), and the markdown table of the levels.

Invariants:
- A record's tokens are counted per chunk from the most explicit field present (token_ids, logprobs tokens,
  masks, text) and, from the final chunk, taken from `usage.completion_tokens`; summarize prefers usage.
- `--mask-check parse` and `count` record the same counts: `count` keeps each token's mask as raw JSON
  (msgspec.Raw) and counts its ids by its commas instead of decoding them into Python ints.
- Accounting only: nothing here sends a request; the one clock read is `time.time()` for a record's first token
  (the clock that all the load generator's client processes share).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import msgspec
    _json_loads = msgspec.json.decode
except ImportError:
    msgspec = None
    _json_loads = json.loads

MASK_CHECKS = ("parse", "count")


@dataclass
class RequestRecord:
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    chunk_tokens: int = 0
    usage_tokens: int | None = None
    masks: int = 0
    mask_ids: int = 0
    has_mask: bool = False
    error: str | None = None


def chunk_token_count(choice: dict[str, Any]) -> int:
    """Tokens carried by one streamed choice, from the most explicit field present."""
    if choice.get("token_ids") is not None:
        return len(choice["token_ids"])
    logprobs = choice.get("logprobs")
    if logprobs is not None and logprobs.get("tokens") is not None:
        return len(logprobs["tokens"])
    if choice.get("sampling_mask") is not None:
        return len(choice["sampling_mask"])
    return 1 if choice.get("text") else 0


if msgspec is not None:
    class _CountedChoice(msgspec.Struct):
        """A streamed choice for `--mask-check count`: each token's mask kept as its raw JSON."""
        text: str | None = None
        token_ids: list[int] | None = None
        logprobs: Any = None
        sampling_mask: list[msgspec.Raw] | None = None

    class _CountedChunk(msgspec.Struct):
        choices: list[_CountedChoice] | None = None
        usage: Any = None
        error: Any = None

    _counted_decoder = msgspec.json.Decoder(_CountedChunk)


def _raw_list_length(raw: Any) -> int:
    """Items of a JSON list of numbers written without spaces inside, from its raw text ("[3,17,42]" -> 3)."""
    text = bytes(raw)
    return 0 if text.strip() == b"[]" else text.count(b",") + 1


def _handle_event(data: bytes | str, rec: RequestRecord, mask_check: str = "parse") -> bool:
    """Account one SSE `data:` payload; True when the stream is over ([DONE] or an error event)."""
    if data in ("[DONE]", b"[DONE]"):
        return True
    if mask_check == "count" and msgspec is not None:
        obj, mask_size = _counted_event(data), _raw_list_length
    else:
        obj, mask_size = _json_loads(data), len
    if "error" in obj:
        rec.error = f"stream error: {str(obj['error'])[:300]}"
        return True
    for choice in obj.get("choices") or []:
        if rec.first_token is None:
            rec.first_token = time.time()
        rec.chunk_tokens += chunk_token_count(choice)
        masks = choice.get("sampling_mask")
        if masks is not None:
            rec.has_mask = True
            rec.masks += len(masks)
            rec.mask_ids += sum(mask_size(m) for m in masks)
    usage = obj.get("usage")
    if usage:
        rec.usage_tokens = int(usage.get("completion_tokens", 0))
    return False


def _counted_event(data: bytes | str) -> dict[str, Any]:
    """The payload as `_handle_event` reads it, each token's mask left as its raw JSON (`--mask-check count`)."""
    chunk = _counted_decoder.decode(data)
    obj: dict[str, Any] = {"usage": chunk.usage, "choices": [
        {"text": c.text, "token_ids": c.token_ids, "logprobs": c.logprobs, "sampling_mask": c.sampling_mask}
        for c in chunk.choices or []]}
    if chunk.error is not None:
        obj["error"] = chunk.error
    return obj


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values), q)) if values else None


def summarize(records: list[RequestRecord], start: float, end: float, concurrency: int,
              input_len: int) -> dict[str, Any]:
    """Aggregate one level's request records into the reported metrics (times in ms, rates per second)."""
    done = [r for r in records if r.error is None and r.end is not None]
    started = [r for r in records if r.start > 0]
    truncated = any(r.error == "timeout" for r in records)
    duration = max(end - start, 1e-9)

    def out_tokens(r: RequestRecord) -> int:
        return r.usage_tokens if r.usage_tokens is not None else r.chunk_tokens

    total_out = sum(out_tokens(r) for r in done) + sum(r.chunk_tokens for r in records if r.error == "timeout")
    ttfts = [(r.first_token - r.start) * 1e3 for r in started if r.first_token is not None]
    tpots = [(r.end - r.first_token) * 1e3 / (out_tokens(r) - 1) for r in done
             if r.first_token is not None and out_tokens(r) > 1]
    e2e = [(r.end - r.start) * 1e3 for r in done]
    counted = [r for r in done if r.usage_tokens is not None and r.chunk_tokens > 0]
    mask_reqs = [r for r in done if r.has_mask]
    errors = [r.error for r in records if r.error is not None and r.error != "timeout"]
    # Steady state: the tokens received in the middle 60% of the level (its ramp-up and drain left out), each
    # request's tokens spread evenly over [its first token, its end].
    lo, hi = start + 0.2 * duration, end - 0.2 * duration
    steady = 0.0
    done_ids = {id(r) for r in done}
    for r in records:
        if r.first_token is None:
            continue
        n = out_tokens(r) if id(r) in done_ids else r.chunk_tokens
        r_end = r.end if r.end is not None else end
        if r_end <= r.first_token:
            steady += n if lo <= r.first_token <= hi else 0
        else:
            steady += n * max(0.0, min(hi, r_end) - max(lo, r.first_token)) / (r_end - r.first_token)
    return {
        "concurrency": concurrency, "num_prompts": len(records), "completed": len(done),
        "failed": len(errors), "timed_out": sum(r.error == "timeout" for r in records),
        "not_started": len(records) - len(started), "truncated": truncated, "duration_s": duration,
        "output_tokens": total_out, "output_throughput": total_out / duration,
        "steady_output_throughput": steady / max(hi - lo, 1e-9),
        "request_throughput": len(done) / duration,
        "total_token_throughput": (total_out + input_len * len(done)) / duration,
        "ttft_ms_median": percentile(ttfts, 50), "ttft_ms_p99": percentile(ttfts, 99),
        "ttft_ms_mean": float(np.mean(ttfts)) if ttfts else None,
        "tpot_ms_median": percentile(tpots, 50), "tpot_ms_p99": percentile(tpots, 99),
        "tpot_ms_mean": float(np.mean(tpots)) if tpots else None,
        "e2e_ms_median": percentile(e2e, 50), "e2e_ms_p99": percentile(e2e, 99),
        "token_count_mismatches": sum(r.usage_tokens != r.chunk_tokens for r in counted),
        "mask_requests": len(mask_reqs), "masks_received": sum(r.masks for r in mask_reqs),
        "mask_count_mismatches": sum(r.masks != out_tokens(r) for r in mask_reqs),
        "mean_mask_size": (sum(r.mask_ids for r in mask_reqs) / max(1, sum(r.masks for r in mask_reqs))
                           if mask_reqs else None),
        "masks_ok": (len(mask_reqs) == len(done) and all(r.masks == out_tokens(r) for r in mask_reqs))
        if mask_reqs else None,
        "errors_sample": errors[:3],
    }


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown_table(results: list[dict[str, Any]]) -> str:
    lines = ["| concurrency | requests | duration (s) | output tok/s | req/s | TTFT med (ms) | TTFT p99 (ms) "
             "| TPOT med (ms) | TPOT p99 (ms) | masks |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        masks = "-" if r["masks_ok"] is None else ("ok" if r["masks_ok"] else f"{r['mask_count_mismatches']} bad")
        lines.append(f"| {r['concurrency']} | {r['completed']}/{r['num_prompts']} | {r['duration_s']:.2f} "
                     f"| {r['output_throughput']:.0f} | {r['request_throughput']:.2f} | {_fmt(r['ttft_ms_median'])} "
                     f"| {_fmt(r['ttft_ms_p99'])} | {_fmt(r['tpot_ms_median'], 2)} | {_fmt(r['tpot_ms_p99'], 2)} "
                     f"| {masks} |")
    return "\n".join(lines)
