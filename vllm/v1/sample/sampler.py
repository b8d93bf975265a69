"""Sampler: logits of the step's rows -> sampled tokens, logprobs and the sampling mask.

Order (the contract of docs/sampling_mask.md): float32 logits -> allowed_token_ids -> bad_words -> logit_bias ->
min_tokens -> repetition / frequency / presence penalties (ops/penalties.py; only when a row uses one) ->
temperature -> min-p -> top-k -> top-p. Each filter writes -inf; the result ("processed logits") is what random
rows draw from and what the sampling mask reads, so the sampled token of a random row is always inside its
support. Tie rules: ops/topk_topp.py.

Invariants:
- Greedy rows (temperature < SAMPLING_EPS, or every row when `all_greedy`) take the argmax of the logits after
  the penalties and processors (as vLLM); their processed logits use temperature 1.0 (the argmax survives every
  later filter).
- The sampler reads the penalty state and never writes it: the caller counts the step's sampled tokens into it
  with `count_sampled` (on the device, before the next step, so its penalties see them before the host does).
- Random rows use the exponential race (ops/sample.py); rows in `generators` use their own generator.
- The input logits are never modified.
- logprobs_mode picks the values of the logprobs output: raw_logprobs / raw_logits are taken before
  temperature, processed_logprobs / processed_logits after every filter (-inf outside the support, and the
  support's probabilities sum to 1).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from vllm.config.model import LOGPROBS_MODES
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.sample.fast_path import fast_path_applies, sample_fast
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.logprobs import gather_logprobs
from vllm.v1.sample.ops.penalties import (apply_allowed, apply_bad_word_prefixes, apply_penalties,
                                          apply_sparse_bias, update_state)
from vllm.v1.sample.ops.sample import random_sample
from vllm.v1.sample.ops.topk_topp import SAMPLING_EPS, process_logits
from vllm.v1.sample.sampling_mask import SamplingMaskTensors



@dataclass(slots=True)
class SamplerOutput:
    # [num_reqs] int64
    sampled_token_ids: torch.Tensor
    logprobs_tensors: LogprobsTensors | None
    sampling_mask: SamplingMaskTensors | None = None


class Sampler(nn.Module):

    def __init__(self, logprobs_mode: str = "raw_logprobs", use_fast_path: bool = True) -> None:
        super().__init__()
        # Benchmarks and tests only: False forces the general full-vocabulary path for every batch.
        self.use_fast_path = use_fast_path
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def forward(self, logits: torch.Tensor, sampling_metadata: SamplingMetadata) -> SamplerOutput:
        """logits: [num_reqs, V], float32 or the model's bf16/fp16 (every value is then used as its exact float32
        conversion, so the results are the same either way)."""
        md = sampling_metadata
        want_logprobs = md.max_num_logprobs is not None
        raw_mode = want_logprobs and self.logprobs_mode in ("raw_logprobs", "raw_logits")
        need_processed = not md.all_greedy or md.sampling_mask_rows is not None or (want_logprobs and not raw_mode)
        fast = need_processed and self._fast_path_ok(logits, md)
        # NOTE: the fast path reads the logits in their own dtype (its top-k select moves half the bytes of bf16)
        # and converts only its candidates and its general-path rows; everything else works on a float32 copy of
        # the whole batch.
        if not fast or raw_mode:
            logits = logits.to(torch.float32)  # [num_reqs, V]
        raw_values: torch.Tensor | None = None
        if want_logprobs and self.logprobs_mode == "raw_logprobs":
            raw_values = logits.log_softmax(dim=-1)
        elif want_logprobs and self.logprobs_mode == "raw_logits":
            raw_values = logits

        if md.processors is not None:
            logits = apply_logits_processors(logits, md)
            if fast and md.processors.allowed_rows is not None and md.top_k is not None:
                # NOTE: a row with fewer finite logits than top_k (allowed_token_ids) has a -inf k-th value, which
                # the candidate select cannot hold; top_k = its finite count keeps the same set (every finite id).
                num_finite = (logits > float("-inf")).sum(dim=-1).clamp_(min=1)
                md = replace(md, top_k=torch.minimum(md.top_k.to(num_finite.device), num_finite).to(torch.int32))

        if fast:
            sampled, logprobs_tensors, mask = sample_fast(logits, md, self.logprobs_mode, raw_values)
            return SamplerOutput(sampled, logprobs_tensors, mask)
        greedy_tokens = None if md.all_random else logits.argmax(dim=-1)
        processed = self.process_logits(logits, md) if need_processed else None

        if md.all_greedy:
            assert greedy_tokens is not None
            sampled = greedy_tokens
        else:
            assert processed is not None
            random_tokens = random_sample(processed.softmax(dim=-1), md.generators)
            if greedy_tokens is None or md.temperature is None:
                sampled = random_tokens
            else:
                sampled = torch.where(md.temperature < SAMPLING_EPS, greedy_tokens, random_tokens)

        logprobs_tensors = None
        if want_logprobs:
            if raw_values is not None:
                values = raw_values
            else:
                assert processed is not None
                values = processed.log_softmax(dim=-1) if self.logprobs_mode == "processed_logprobs" else processed
            logprobs_tensors = gather_logprobs(values, md.max_num_logprobs, sampled)

        sampling_mask = None
        if md.sampling_mask_rows is not None:
            assert processed is not None
            sampling_mask = SamplingMaskTensors.from_logits(processed, md.sampling_mask_rows, md.max_top_k)
        return SamplerOutput(sampled, logprobs_tensors, sampling_mask)

    def _fast_path_ok(self, logits: torch.Tensor, md: SamplingMetadata) -> bool:
        return self.use_fast_path and fast_path_applies(md, logits.shape[1])

    @staticmethod
    def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p on a copy of `logits` ([num_reqs, V] float32)."""
        return process_logits(logits, md.temperature, md.min_p, md.top_k, md.top_p, md.max_top_k)


def apply_logits_processors(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """A float32 copy of `logits` ([num_reqs, V]) with the step's processors and penalties applied, in vLLM's
    order (ops/penalties.py)."""
    proc = md.processors
    assert proc is not None
    has_bias = proc.bias_rows is not None and proc.bias_ids is not None and proc.bias_values is not None
    if proc.any_penalty and not has_bias:
        # NOTE: the -inf writes of allowed_token_ids and bad_words commute with the penalties, so without a bias
        # entry the penalty kernel reads the model's logits and writes the float32 copy in one pass.
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)  # [num_reqs, V]
        _penalties(logits, md, out)
    else:
        out = logits.to(torch.float32, copy=True)  # [num_reqs, V]
        if has_bias:
            apply_sparse_bias(out, proc.bias_rows, proc.bias_ids, proc.bias_values)
        if proc.any_penalty:
            _penalties(out, md, out)
    if proc.allowed_rows is not None and proc.allowed_ids is not None:
        apply_allowed(out, proc.allowed_rows, proc.allowed_ids)
    if proc.bad_rows is not None and proc.bad_prefixes is not None and proc.bad_last_ids is not None:
        assert md.penalty_slot is not None
        apply_bad_word_prefixes(out, proc.recent, md.penalty_slot, proc.bad_rows, proc.bad_prefixes,
                                proc.bad_last_ids)
    return out


def _penalties(logits: torch.Tensor, md: SamplingMetadata, out: torch.Tensor) -> None:
    assert (md.processors is not None and md.penalty_slot is not None and md.repetition_penalty is not None
            and md.frequency_penalty is not None and md.presence_penalty is not None)
    apply_penalties(logits, md.processors.state, md.penalty_slot, md.repetition_penalty, md.frequency_penalty,
                    md.presence_penalty, out=out)


def count_sampled(md: SamplingMetadata, sampled: torch.Tensor) -> None:
    """Count the step's sampled tokens ([num_reqs]) into the rows' penalty state slots (ops/penalties.py)."""
    if md.processors is not None and md.penalty_slot is not None and md.penalty_weight is not None:
        update_state(md.processors.state, md.processors.recent, md.penalty_slot, md.penalty_weight, sampled)
