"""InputBatch: the model runner's persistent per-request state, one row per request, in host numpy arrays.

Rows are dense: a removed request's row is filled by moving the last row into it, so rows 0..num_reqs-1 are
live. The runner keeps each request's token ids (prompt + every sampled token) so the scheduler only sends
block ids and counts after a request's first step.

A token sampled in a step is counted in `num_tokens` at once, but its value reaches `token_ids_cpu` only when
the step's output is on the host (ModelRunner._write_sampled, run by the step's `get_output()`); until then
`prev_sampled_idx` of the row says where it sits in the previous step's device tensor of sampled ids, from which
the next step's input ids take it (so a step can start before the previous one's tokens are on the host).

Penalties and logits processors: a request that uses any has its `RequestProcessors` in `processors` (by req_id)
and, when it needs device state (a penalty or a multi-token bad word), a slot of the `PenaltyState` pool
(`penalty_slot`, -1 otherwise), taken at add_request and given back at remove_request (vllm/v1/worker/
penalty_state.py).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm.sampling_params import _SAMPLING_EPS, SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.penalty_state import PenaltyState, RequestProcessors


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int, vocab_size: int,
                 device: torch.device, return_sampling_mask: bool) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = device
        self.return_sampling_mask = return_sampling_mask
        self.req_ids: list[str] = []
        self.req_id_to_index: dict[str, int] = {}

        # [max_num_reqs, max_model_len] int32: prompt + output token ids of each row.
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        # [max_num_reqs, max_num_blocks_per_req] int32
        self.block_table = np.zeros((max_num_reqs, max_num_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)

        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.full(max_num_reqs, vocab_size, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.greedy = np.zeros(max_num_reqs, dtype=bool)
        # -1 where the row asks for no logprobs.
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)
        self.wants_mask = np.zeros(max_num_reqs, dtype=bool)
        # The API server of each row's request: the group its sampling-mask text is packed with.
        self.client_index = np.zeros(max_num_reqs, dtype=np.int32)
        self.seeded = np.zeros(max_num_reqs, dtype=bool)
        self.generators: dict[str, torch.Generator] = {}
        # Index of the row's token in the previous step's sampled ids; -1 when the row did not sample there.
        self.prev_sampled_idx = np.full(max_num_reqs, -1, dtype=np.int32)
        # Penalties and logits processors (module docstring).
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.has_processors = np.zeros(max_num_reqs, dtype=bool)
        # Rows with sparse entries (logit_bias, min_tokens, allowed_token_ids, bad_words).
        self.has_entries = np.zeros(max_num_reqs, dtype=bool)
        self.penalty_slot = np.full(max_num_reqs, -1, dtype=np.int64)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.processors: dict[str, RequestProcessors] = {}
        self.penalty_state = PenaltyState(max_num_reqs, vocab_size, device)

        self._row_arrays = [self.token_ids_cpu, self.num_tokens, self.num_computed_tokens, self.block_table,
                            self.num_blocks, self.temperature, self.top_p, self.top_k, self.min_p, self.greedy,
                            self.num_logprobs, self.wants_mask, self.client_index, self.seeded,
                            self.prev_sampled_idx, self.num_prompt_tokens, self.has_processors, self.has_entries,
                            self.penalty_slot, self.repetition_penalty, self.frequency_penalty,
                            self.presence_penalty]

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    def add_request(self, req: NewRequestData) -> None:
        row = self.num_reqs
        assert row < self.max_num_reqs and req.req_id not in self.req_id_to_index
        self.req_ids.append(req.req_id)
        self.req_id_to_index[req.req_id] = row
        n_prompt, n_out = len(req.prompt_token_ids), len(req.output_token_ids)
        self.token_ids_cpu[row, :n_prompt] = req.prompt_token_ids
        self.token_ids_cpu[row, n_prompt:n_prompt + n_out] = req.output_token_ids
        self.num_tokens[row] = n_prompt + n_out
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self.prev_sampled_idx[row] = -1
        self.client_index[row] = req.client_index
        self.append_block_ids(row, req.block_ids)
        self.num_prompt_tokens[row] = n_prompt
        self._set_sampling_params(row, req.req_id, req.sampling_params, num_generated=n_out)
        self._set_processors(row, req)

    def _set_sampling_params(self, row: int, req_id: str, sp: SamplingParams, num_generated: int) -> None:
        greedy = sp.temperature < _SAMPLING_EPS
        self.greedy[row] = greedy
        self.temperature[row] = 0.0 if greedy else sp.temperature
        self.top_p[row] = sp.top_p
        self.top_k[row] = sp.top_k if 0 < sp.top_k < self.vocab_size else self.vocab_size
        self.min_p[row] = sp.min_p
        self.num_logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        self.wants_mask[row] = self.return_sampling_mask and sp.return_sampling_mask is not False
        self.seeded[row] = sp.seed is not None and not greedy
        if sp.seed is not None and not greedy:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(sp.seed)
            # NOTE: a request resumed after preemption skips the draws of the tokens it already has, so its
            # remaining tokens are the ones it would have drawn without the preemption.
            scratch = torch.empty(self.vocab_size, device=self.device)
            for _ in range(num_generated):
                scratch.exponential_(generator=gen)
            self.generators[req_id] = gen

    def _set_processors(self, row: int, req: NewRequestData) -> None:
        procs = RequestProcessors.from_params(req.sampling_params, req.eos_token_id)
        self.has_processors[row] = procs is not None
        self.has_entries[row] = procs is not None and procs.has_entries
        self.penalty_slot[row] = -1
        self.repetition_penalty[row], self.frequency_penalty[row], self.presence_penalty[row] = 1.0, 0.0, 0.0
        if procs is None:
            return
        self.processors[req.req_id] = procs
        self.repetition_penalty[row] = procs.repetition
        self.frequency_penalty[row] = procs.frequency
        self.presence_penalty[row] = procs.presence
        if procs.needs_state:
            max_prefix = max((len(p) for p in procs.bad_prefixes), default=0)
            self.penalty_slot[row] = self.penalty_state.alloc(req.prompt_token_ids, req.output_token_ids,
                                                              max_prefix)

    def append_block_ids(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def remove_request(self, req_id: str) -> None:
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return
        self.generators.pop(req_id, None)
        self.processors.pop(req_id, None)
        if self.penalty_slot[row] >= 0:
            self.penalty_state.free(int(self.penalty_slot[row]))
            self.penalty_slot[row] = -1
        last = self.num_reqs - 1
        last_id = self.req_ids.pop()
        if row != last:
            self.req_ids[row] = last_id
            self.req_id_to_index[last_id] = row
            for arr in self._row_arrays:
                arr[row] = arr[last]
