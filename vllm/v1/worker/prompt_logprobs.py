"""Prompt logprobs in the model runner (SamplingParams.prompt_logprobs): the logprobs of each prompt token given
the tokens before it, computed from the hidden states of the prompt positions during prefill.

A prompt of P tokens has P - 1 rows: the hidden state at position j gives row j, the distribution of prompt token
j + 1 (the first prompt token has no row). A step that computes positions [s, s + n) of a tracked request fills rows
[s, min(s + n, P - 1)), so a prompt chunked over several steps (chunked prefill) is filled chunk by chunk.

Invariants:
- Only the requests that ask pay: a step without one runs as before (no extra logits, indices or copies); a
  step with some computes the LM head over their prompt rows only, in passes of at most MAX_ROWS_PER_PASS rows
  (bounding the [rows, vocab] float32 logprobs), after the step's forward and sampler.
- Rows are the raw float32 log-softmax of the model's logits (vLLM's prompt logprobs ignore logprobs_mode,
  temperature and every other sampling setting). Row r holds the prompt token first, then the top k (k = -1: the
  whole vocabulary) in descending order; the prompt token's rank counts the tokens whose logprob is >= its own
  (vLLM's rank: 1 is the most likely, ties count against it).
- Chunks reach the host with their step's output (`get_output()`, called in step order) and are joined there;
  a request's PromptLogprobs goes out in the ModelRunnerOutput of the step that computed its last prompt
  position, which is the step where it first samples (so the scheduler has an output to carry it).
- A request is tracked from its first add without output tokens until that step: one resumed after preemption
  with outputs already had its prompt logprobs (never sent twice); one preempted during its prefill starts over
  (its prompt is recomputed from position 0). A prompt prefix served from a cache has no hidden states, so the
  scheduler must not give these requests cached blocks (Request.skip_reading_prefix_cache); a first chunk that
  starts past position 0 is an error, never a silent gap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import PromptLogprobs

# NOTE: 256 rows x a 152k vocabulary is ~0.16 GB of float32 logprobs per pass (about what the sampler's profiled
# [max_num_seqs, vocab] float32 logits take, so it fits the memory the KV cache left); a whole 8k-token chunk at
# once would be ~5 GB.
MAX_ROWS_PER_PASS = 256


@dataclass(slots=True)
class _Tracked:
    num_logprobs: int
    # [P] int64
    prompt_token_ids: np.ndarray
    # Rows launched so far (the next step's first row must be this one).
    next_row: int = 0
    # Host chunks in row order: (token ids [r, k + 1] int32, logprobs [r, k + 1] float32, ranks [r] int32).
    chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=list)

    def result(self) -> PromptLogprobs:
        k1 = self.num_logprobs + 1
        if not self.chunks:
            return PromptLogprobs(np.zeros((0, k1), np.int32), np.zeros((0, k1), np.float32),
                                  np.zeros(0, np.int32))
        ids, lps, ranks = (np.concatenate(parts) for parts in zip(*self.chunks))
        return PromptLogprobs(ids, lps, ranks)


@dataclass(slots=True)
class _Segment:
    tracked: _Tracked
    req_id: str
    # Rows [start, end) of the step's flat prompt-logprob rows.
    start: int
    end: int
    completes: bool


class PendingPromptLogprobs:
    """One step's prompt-logprob rows on their way to the host."""

    def __init__(self, segments: list[_Segment], tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                 event: torch.cuda.Event | None) -> None:
        self.segments = segments
        self.tensors = tensors
        self.event = event

    def resolve(self) -> dict[str, PromptLogprobs] | None:
        """Append the step's chunks to their requests; the PromptLogprobs of the requests this step completed."""
        if self.event is not None:
            self.event.synchronize()
        ids, lps, ranks = (t.numpy() for t in self.tensors)
        done: dict[str, PromptLogprobs] = {}
        for seg in self.segments:
            k1 = seg.tracked.num_logprobs + 1
            if seg.end > seg.start:
                seg.tracked.chunks.append((ids[seg.start:seg.end, :k1].copy(), lps[seg.start:seg.end, :k1].copy(),
                                           ranks[seg.start:seg.end].copy()))
            if seg.completes:
                done[seg.req_id] = seg.tracked.result()
        return done or None


class WithPromptLogprobs:
    """A step's AsyncModelRunnerOutput whose output also carries the prompt logprobs the step completed."""

    def __init__(self, inner: Any, pending: PendingPromptLogprobs) -> None:
        self._inner = inner
        self._pending: PendingPromptLogprobs | None = pending

    def get_output(self) -> Any:
        out = self._inner.get_output()
        if self._pending is not None:
            out.prompt_logprobs_dict = self._pending.resolve()
            self._pending = None
        return out


class PromptLogprobsComputer:
    """The runner's prompt-logprob requests (by request id) and the per-step computation over their rows."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.requests: dict[str, _Tracked] = {}

    def add(self, req_id: str, params: SamplingParams, prompt_token_ids: list[int], num_output_tokens: int) -> None:
        self.requests.pop(req_id, None)
        if params.prompt_logprobs is None or num_output_tokens:
            return
        k = self.vocab_size if params.prompt_logprobs == -1 else min(params.prompt_logprobs, self.vocab_size)
        self.requests[req_id] = _Tracked(k, np.asarray(prompt_token_ids, dtype=np.int64))

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)

    def compute(self, req_ids: list[str], num_computed: np.ndarray, num_scheduled: np.ndarray,
                hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
                ) -> PendingPromptLogprobs | None:
        """Launch this step's prompt logprobs: req_ids / num_computed / num_scheduled are the step's requests in
        flat order (num_computed before the step), `hidden` the forward's hidden states by flat token row."""
        segments: list[_Segment] = []
        flat_parts: list[np.ndarray] = []
        target_parts: list[np.ndarray] = []
        num_rows = 0
        offsets = np.cumsum(num_scheduled) - num_scheduled  # [num_reqs] first flat row of each request
        for i, req_id in enumerate(req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            start, n = int(num_computed[i]), int(num_scheduled[i])
            num_prompt = len(tracked.prompt_token_ids)
            if start != tracked.next_row:
                raise RuntimeError(f"Request {req_id!r}: prompt logprobs need every prompt position computed in "
                                   f"order, but this step starts at position {start} after {tracked.next_row} "
                                   "(a prompt prefix served from a cache has no logits).")
            end = min(start + n, num_prompt - 1)
            rows = max(end - start, 0)
            completes = start + n >= num_prompt
            if rows:
                flat_parts.append(np.arange(int(offsets[i]), int(offsets[i]) + rows, dtype=np.int64))
                target_parts.append(tracked.prompt_token_ids[start + 1:end + 1])
                tracked.next_row = end
            segments.append(_Segment(tracked, req_id, num_rows, num_rows + rows, completes))
            num_rows += rows
            if completes:
                del self.requests[req_id]
        if not segments:
            return None
        k_max = max(seg.tracked.num_logprobs for seg in segments)
        ids = torch.empty((num_rows, k_max + 1), dtype=torch.int32, device=self.device)
        lps = torch.empty((num_rows, k_max + 1), dtype=torch.float32, device=self.device)
        ranks = torch.empty(num_rows, dtype=torch.int32, device=self.device)
        if num_rows:
            flat = torch.from_numpy(np.concatenate(flat_parts)).to(self.device, non_blocking=True)
            targets = torch.from_numpy(np.concatenate(target_parts)).to(self.device, non_blocking=True)
            for a in range(0, num_rows, MAX_ROWS_PER_PASS):
                b = min(a + MAX_ROWS_PER_PASS, num_rows)
                self._rows(compute_logits(hidden[flat[a:b]]), targets[a:b], k_max, ids[a:b], lps[a:b], ranks[a:b])
        return PendingPromptLogprobs(segments, *self._to_host(ids, lps, ranks))

    @staticmethod
    def _rows(logits: torch.Tensor, targets: torch.Tensor, k: int, ids: torch.Tensor, lps: torch.Tensor,
              ranks: torch.Tensor) -> None:
        """Fill one pass's rows: logits [r, V] (the model's dtype), targets [r] int64."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [r, V] float32
        target_lp = logprobs.gather(1, targets[:, None])  # [r, 1]
        ranks.copy_((logprobs >= target_lp).sum(dim=-1))
        ids[:, 0] = targets
        lps[:, :1] = target_lp
        if k:
            top_lp, top_ids = logprobs.topk(k, dim=-1)
            ids[:, 1:] = top_ids
            lps[:, 1:] = top_lp

    def _to_host(self, ids: torch.Tensor, lps: torch.Tensor, ranks: torch.Tensor
                 ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.cuda.Event | None]:
        if self.device.type != "cuda":
            return (ids.cpu(), lps.cpu(), ranks.cpu()), None
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (ids, lps, ranks))
        for h, t in zip(host, (ids, lps, ranks)):
            h.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event  # type: ignore[return-value]
