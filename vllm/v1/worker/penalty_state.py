"""Penalty state and the step's logits-processor entries: the host side of ops/penalties.py.

Role: `PenaltyState` is a pool of device rows ("slots") that requests with a repetition, frequency or presence
penalty, or a multi-token bad word, own while they are in the batch: per (slot, token) one int32 (output count |
PROMPT_BIT) and per slot the last W output tokens. `RequestProcessors` is one request's settings as arrays; the
step's entries (`build_processor_tensors`) are built from them with numpy into persistent buffers.

Invariants:
- A slot is written at allocation (the prompt's presence bits, the counts and recent tokens of the outputs a
  resumed request already has) and after that only by the sampler, which counts each sampled token on the device
  in the step's call (its CUDA graph), so the next step sees it whether or not the host has the token yet (async
  scheduling). A preempted request frees its slot; when it resumes, its slot is rebuilt from prompt + outputs.
- The last slot (index `capacity`) is the scratch slot: all zeros and recent tokens -1; rows without state read it
  and the sampler adds 0 to it.
- The pool is allocated on the first request that needs it with min(64, max_num_seqs) slots and grows once, to
  max_num_seqs slots, when more rows need one; the recent-token width W starts at 16 and doubles for a longer bad
  word. A new allocation changes the tensors' addresses, which the sampler graphs' key includes (a graph never
  replays on a freed pool).
- Memory: (max_num_seqs + 1) x V x 4 bytes at most (1024 x 151936 x 4 = 622 MB for Qwen at 1024 streams), only
  once more than 64 requests with penalties run at once; vLLM's per-step scatter builds two [num_reqs, V + 1]
  int64 tensors (2.5 GB at 1024 rows) instead. NOTE: the pool is allocated after the KV cache is sized, from what
  gpu_memory_utilization leaves free.
- A batch with no such request builds nothing and the sampler's metadata has no processor fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.sampling_params import SamplingParams
from vllm.v1.sample.metadata import LogitsProcessorTensors
from vllm.v1.sample.ops.penalties import PROMPT_BIT

if TYPE_CHECKING:
    from vllm.v1.worker.input_batch import InputBatch
    from vllm.v1.worker.input_prep import InputBuffers

_INITIAL_SLOTS = 64
_INITIAL_WIDTH = 16
_MIN_BUCKET = 16


@dataclass(slots=True)
class RequestProcessors:
    """One request's penalties and processors, as arrays (see ops/penalties.py for their meaning)."""
    repetition: float
    frequency: float
    presence: float
    # logit_bias and single-token bad words (-inf): [n] int64 ids, float32 values.
    bias_ids: np.ndarray
    bias_values: np.ndarray
    # min_tokens and the ids banned before it is reached (EOS and the stop token ids).
    min_tokens: int
    stop_ids: np.ndarray
    # [n] int64, or None when every id is allowed.
    allowed_ids: np.ndarray | None
    # Multi-token bad words: prefixes (all but the last token) and last tokens.
    bad_prefixes: list[list[int]]
    bad_last_ids: list[int]

    @property
    def has_penalty(self) -> bool:
        return self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0

    @property
    def needs_state(self) -> bool:
        return self.has_penalty or bool(self.bad_prefixes)

    @property
    def has_entries(self) -> bool:
        return bool(self.bias_ids.size) or self.min_tokens > 0 or self.allowed_ids is not None \
            or bool(self.bad_prefixes)

    @classmethod
    def from_params(cls, sp: SamplingParams, eos_token_id: int | None) -> RequestProcessors | None:
        """None when the request uses none of them."""
        bias = dict(sp.logit_bias or {})
        prefixes: list[list[int]] = []
        last_ids: list[int] = []
        for word in sp._bad_words_token_ids or []:
            if len(word) == 1:
                bias[word[0]] = float("-inf")
            elif word:
                prefixes.append(list(word[:-1]))
                last_ids.append(word[-1])
        # NOTE: vLLM bans every id of all_stop_token_ids, which holds the model's EOS even with ignore_eos.
        stop = set(sp.all_stop_token_ids) | set(sp.stop_token_ids or [])
        if eos_token_id is not None:
            stop.add(eos_token_id)
        min_tokens = sp.min_tokens if stop else 0
        p = cls(float(sp.repetition_penalty), float(sp.frequency_penalty), float(sp.presence_penalty),
                np.fromiter(bias.keys(), dtype=np.int64, count=len(bias)),
                np.fromiter(bias.values(), dtype=np.float32, count=len(bias)),
                min_tokens, np.array(sorted(stop), dtype=np.int64),
                None if sp.allowed_token_ids is None else np.asarray(sp.allowed_token_ids, dtype=np.int64),
                prefixes, last_ids)
        return p if p.needs_state or p.has_entries else None


class PenaltyState:
    """The device pool of penalty state slots (module docstring)."""

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device) -> None:
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.device = device
        self.capacity = 0
        self.width = _INITIAL_WIDTH
        # [capacity + 1, V] int32 and [capacity + 1, W] int32; allocated on the first alloc().
        self.state = torch.zeros((1, vocab_size), dtype=torch.int32, device=device)
        self.recent = torch.full((1, self.width), -1, dtype=torch.int32, device=device)
        self._free: list[int] = []

    @property
    def scratch(self) -> int:
        return self.capacity

    def alloc(self, prompt_ids: list[int] | np.ndarray, output_ids: list[int] | np.ndarray,
              max_prefix_len: int) -> int:
        """A slot holding the prompt's presence bits and the outputs' counts and last tokens."""
        if not self._free:
            self._grow(min(_INITIAL_SLOTS, self.max_slots) if self.capacity == 0 else self.max_slots, self.width)
        if max_prefix_len > self.width:
            self._grow(self.capacity, 1 << (max_prefix_len - 1).bit_length())
        slot = self._free.pop()
        row = self.state[slot]  # [V]
        row.zero_()
        row.index_fill_(0, self._to_device(np.asarray(prompt_ids, dtype=np.int64)), PROMPT_BIT)
        outputs = np.asarray(output_ids, dtype=np.int64)
        if outputs.size:
            out = self._to_device(outputs)
            row.index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        recent = np.full(self.width, -1, dtype=np.int32)
        tail = outputs[-self.width:]
        recent[self.width - tail.size:] = tail
        self.recent[slot].copy_(self._to_device(recent))
        return slot

    def _to_device(self, values: np.ndarray) -> torch.Tensor:
        # NOTE: through pinned memory, non-blocking: a copy from pageable memory would wait for the step in flight
        # (async scheduling would lose its overlap at every new request with penalties). The caching host
        # allocator keeps the pinned block until the copy has run.
        host = torch.from_numpy(values)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def _grow(self, capacity: int, width: int) -> None:
        if capacity <= self.capacity and not self._free and width == self.width:
            raise RuntimeError(f"penalty state: all {self.capacity} slots are taken (max_num_seqs)")
        old_cap, old_width = self.capacity, self.width
        state = torch.zeros((capacity + 1, self.vocab_size), dtype=torch.int32, device=self.device)
        recent = torch.full((capacity + 1, width), -1, dtype=torch.int32, device=self.device)
        if old_cap:
            state[:old_cap].copy_(self.state[:old_cap])
            recent[:old_cap, width - old_width:].copy_(self.recent[:old_cap])
        self.state, self.recent, self.capacity, self.width = state, recent, capacity, width
        self._free = sorted(set(self._free) | set(range(old_cap, capacity)), reverse=True)


class EntryBuffers:
    """Persistent host + device buffers of the sparse entry lists, one set per bucketed length, so that a sampler
    graph captured for a length keeps reading the same addresses."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def put(self, name: str, values: np.ndarray, pad: float | int, dtype: torch.dtype) -> torch.Tensor:
        """values ([n, ...]) padded with `pad` to a bucketed n, copied to its persistent device buffer."""
        n = values.shape[0]
        bucket = max(_MIN_BUCKET, 1 << max(0, n - 1).bit_length())
        key = (name, bucket if values.ndim == 1 else bucket * 1000 + values.shape[1])
        if key not in self._bufs:
            on_cuda = self.device.type == "cuda"
            host = torch.zeros((bucket, *values.shape[1:]), dtype=dtype, pin_memory=on_cuda)
            dev = torch.zeros_like(host, device=self.device) if on_cuda else host
            self._bufs[key] = (host, dev)
        host, dev = self._bufs[key]
        h = host.numpy()
        h[:n] = values
        h[n:] = pad
        if dev is not host:
            dev.copy_(host, non_blocking=True)
        return dev


def build_processor_tensors(procs: list[tuple[int, RequestProcessors]], any_penalty: bool, slots: np.ndarray,
                            num_outputs: np.ndarray, pool: PenaltyState, buffers: EntryBuffers,
                            vocab_size: int) -> LogitsProcessorTensors:
    """The step's sparse entries: procs holds (step row, settings) of the rows with entries (has_entries), slots
    ([num_reqs]) each row's slot, num_outputs ([num_reqs]) its output tokens before this step's; any_penalty:
    whether a row of the step has a repetition, frequency or presence penalty."""
    bias_rows: list[np.ndarray] = []
    bias_ids: list[np.ndarray] = []
    bias_vals: list[np.ndarray] = []
    allowed_rows: list[np.ndarray] = []
    allowed_ids: list[np.ndarray] = []
    bad_rows: list[int] = []
    bad_prefixes: list[list[int]] = []
    bad_last: list[int] = []
    for i, p in procs:
        if p.bias_ids.size:
            bias_rows.append(np.full(p.bias_ids.size, i, dtype=np.int64))
            bias_ids.append(p.bias_ids)
            bias_vals.append(p.bias_values)
        if p.min_tokens and num_outputs[i] < p.min_tokens:
            bias_rows.append(np.full(p.stop_ids.size, i, dtype=np.int64))
            bias_ids.append(p.stop_ids)
            bias_vals.append(np.full(p.stop_ids.size, -np.inf, dtype=np.float32))
        if p.allowed_ids is not None:
            allowed_rows.append(np.full(p.allowed_ids.size + 1, i, dtype=np.int64))
            allowed_ids.append(np.concatenate([[vocab_size], p.allowed_ids]))
        if p.bad_prefixes and slots[i] != pool.scratch:
            bad_rows.extend([i] * len(p.bad_prefixes))
            bad_prefixes.extend(p.bad_prefixes)
            bad_last.extend(p.bad_last_ids)

    out = LogitsProcessorTensors(state=pool.state, recent=pool.recent, any_penalty=any_penalty)
    if bias_rows:
        out.bias_rows = buffers.put("bias_rows", np.concatenate(bias_rows), 0, torch.int64)
        out.bias_ids = buffers.put("bias_ids", np.concatenate(bias_ids), 0, torch.int64)
        out.bias_values = buffers.put("bias_values", np.concatenate(bias_vals), 0.0, torch.float32)
    if allowed_rows:
        out.allowed_rows = buffers.put("allowed_rows", np.concatenate(allowed_rows), 0, torch.int64)
        out.allowed_ids = buffers.put("allowed_ids", np.concatenate(allowed_ids), vocab_size + 1, torch.int64)
    if bad_rows:
        width = pool.width
        prefixes = np.full((len(bad_rows), width), -2, dtype=np.int64)
        for j, prefix in enumerate(bad_prefixes):
            prefixes[j, width - len(prefix):] = prefix
        out.bad_rows = buffers.put("bad_rows", np.asarray(bad_rows, dtype=np.int64), 0, torch.int64)
        out.bad_prefixes = buffers.put("bad_prefixes", prefixes, -2, torch.int64)
        out.bad_last_ids = buffers.put("bad_last_ids", np.asarray(bad_last, dtype=np.int64), -1, torch.int64)
    return out


def step_penalty_fields(batch: InputBatch, req_ids: list[str], rows: np.ndarray, samples: np.ndarray,
                        buffers: InputBuffers, tensor: Callable[[Any, np.ndarray, float | int], Any],
                        vocab_size: int) -> dict[str, Any]:
    """The SamplingMetadata fields of penalties and processors for a step's rows (rows: [num_reqs] batch rows,
    samples: [num_reqs] bool), through `tensor(buffer, values, neutral)` (the runner's padded copy into its
    persistent buffers); {} when no row uses any, so that such a step builds and copies nothing."""
    if not bool(batch.has_processors[rows].any()):
        return {}
    pool = batch.penalty_state
    slots = np.where(batch.penalty_slot[rows] >= 0, batch.penalty_slot[rows], pool.scratch)
    rep, freq, pres = batch.repetition_penalty[rows], batch.frequency_penalty[rows], batch.presence_penalty[rows]
    any_penalty = bool(((rep != 1.0) | (freq != 0.0) | (pres != 0.0)).any())
    procs = [(i, batch.processors[req_ids[i]]) for i in np.flatnonzero(batch.has_entries[rows]).tolist()]
    num_outputs = batch.num_tokens[rows] - batch.num_prompt_tokens[rows]
    return dict(
        processors=build_processor_tensors(procs, any_penalty, slots, num_outputs, pool, buffers.processor_entries,
                                           vocab_size),
        penalty_slot=tensor(buffers.penalty_slot, slots, pool.scratch),
        penalty_weight=tensor(buffers.penalty_weight, (slots != pool.scratch) & samples, 0),
        repetition_penalty=tensor(buffers.repetition_penalty, rep, 1.0),
        frequency_penalty=tensor(buffers.frequency_penalty, freq, 0.0),
        presence_penalty=tensor(buffers.presence_penalty, pres, 0.0))
