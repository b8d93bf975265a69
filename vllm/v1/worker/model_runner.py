"""ModelRunner: turns a SchedulerOutput into one forward pass plus sampling, and returns ModelRunnerOutput.

Each step is flattened into varlen metadata with vectorised numpy over the persistent InputBatch (no per-token
Python loops): request i's scheduled tokens are rows query_start_loc[i]:query_start_loc[i+1] of the flat batch.
Only rows whose scheduled tokens reach the end of their known tokens sample; a partial prefill chunk produces no
token, no logprobs and an empty sampling-mask row.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.layer import set_attn_backend
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput, SamplingMaskLists
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.worker.input_batch import InputBatch


class ModelRunner:
    def __init__(self, vllm_config: VllmConfig) -> None:
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        self.device = vllm_config.device_config.torch_device
        self.dtype = vllm_config.dtype
        self.block_size = vllm_config.cache_config.block_size
        self.max_model_len = int(mc.max_model_len or 0)
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.vocab_size = mc.vocab_size
        self.num_layers = mc.num_layers
        self.num_kv_heads = mc.num_kv_heads
        self.head_size = mc.head_size
        self.return_sampling_mask = mc.return_sampling_mask

        torch.manual_seed(mc.seed)
        self.model = get_model(mc, self.device, self.dtype)
        self.attn_backend = get_attn_backend(self.device)
        set_attn_backend(self.model, self.attn_backend)
        self.sampler = Sampler(mc.logprobs_mode, legacy_sampling_mask=envs.VLLM_SAMPLING_MASK_LEGACY_PATH)
        self.max_num_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req,
                                      self.vocab_size, self.device, self.return_sampling_mask)
        self.kv_caches: list[torch.Tensor] = []
        self._arange_np = np.arange(max(self.max_num_tokens, self.max_model_len) + 1, dtype=np.int64)

    # ---- KV cache -------------------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem * self.num_layers

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward of a full token budget and one sampler call over max_num_seqs rows, on a scratch KV
        cache, so that the peak activation memory is known before the KV cache is sized."""
        num_tokens = min(self.max_num_tokens, self.max_model_len)
        num_blocks = -(-num_tokens // self.block_size)
        self.initialize_kv_cache(num_blocks)
        md = AttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=1, max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            block_table=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None],
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=self.device),
            query_start_loc_cpu=torch.tensor([0, num_tokens], dtype=torch.int32),
            seq_lens_cpu=torch.tensor([num_tokens], dtype=torch.int32))
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
        with set_forward_context(md, self.kv_caches):
            hidden = self.model(input_ids, positions)
        idx = torch.arange(self.max_num_reqs, device=self.device) % num_tokens
        logits = self.model.compute_logits(hidden[idx]).float()
        n = self.max_num_reqs
        meta = SamplingMetadata(
            temperature=torch.ones(n, device=self.device), all_greedy=False, all_random=True,
            top_p=torch.full((n,), 0.9, device=self.device), top_k=torch.full((n,), 512, dtype=torch.int32,
                                                                              device=self.device),
            min_p=None, max_num_logprobs=self.vllm_config.model_config.max_logprobs, max_top_k=512,
            sampling_mask_rows=torch.ones(n, dtype=torch.int32, device=self.device)
            if self.return_sampling_mask else None)
        self.sampler(logits, meta)
        self.kv_caches = []

    # ---- One step ---------------------------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        for req_id in so.finished_req_ids:
            batch.remove_request(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: its old row is stale
            batch.add_request(new)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            row = batch.req_id_to_index[req_id]
            batch.num_computed_tokens[row] = num_computed
            if new_blocks:
                batch.append_block_ids(row, new_blocks)

    def _to_device(self, arr: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        # The step's requests, in row order.
        req_ids = [r for r in batch.req_ids if r in so.num_scheduled_tokens]
        rows = np.array([batch.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        num_sched = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int64)
        num_reqs, total = len(req_ids), int(num_sched.sum())

        cu = np.cumsum(num_sched)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        query_start_loc[1:] = cu
        req_indices = np.repeat(rows, num_sched)  # [total] batch row of each token
        offsets = self._arange_np[:total] - np.repeat(cu - num_sched, num_sched)
        computed = batch.num_computed_tokens[rows].astype(np.int64)
        positions = np.repeat(computed, num_sched) + offsets  # [total]
        input_ids = batch.token_ids_cpu[req_indices, positions].astype(np.int64)
        block_ids = batch.block_table[req_indices, positions // self.block_size].astype(np.int64)
        slot_mapping = block_ids * self.block_size + positions % self.block_size
        seq_lens = (computed + num_sched).astype(np.int32)
        # Rows whose tokens reach the end of what is known sample a new token.
        samples = seq_lens == batch.num_tokens[rows]

        md = AttentionMetadata(
            num_actual_tokens=total, num_reqs=num_reqs, max_query_len=int(num_sched.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc=self._to_device(query_start_loc), seq_lens=self._to_device(seq_lens),
            block_table=self._to_device(np.ascontiguousarray(batch.block_table[rows])),
            slot_mapping=self._to_device(slot_mapping),
            query_start_loc_cpu=torch.from_numpy(query_start_loc), seq_lens_cpu=torch.from_numpy(seq_lens))
        with set_forward_context(md, self.kv_caches):
            hidden = self.model(self._to_device(input_ids), self._to_device(positions))
        logits_indices = self._to_device((cu - 1).astype(np.int64))
        logits = self.model.compute_logits(hidden[logits_indices]).float()  # [num_reqs, V] float32

        meta = self._sampling_metadata(rows, req_ids, samples)
        out = self.sampler(logits, meta)
        sampled = out.sampled_token_ids.cpu().numpy()

        # Record the new tokens in the persistent batch (the next step's inputs).
        sample_rows = rows[samples]
        batch.token_ids_cpu[sample_rows, batch.num_tokens[sample_rows]] = sampled[samples]
        batch.num_tokens[sample_rows] += 1
        sampled_token_ids = [[int(t)] if s else [] for t, s in zip(sampled.tolist(), samples.tolist())]

        logprobs = out.logprobs_tensors.tolists() if out.logprobs_tensors is not None else None
        masks: SamplingMaskLists | None = None
        if out.sampling_mask is not None:
            masks = out.sampling_mask.to_cpu_nonblocking().tolists()
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled_token_ids, logprobs=logprobs, sampling_masks=masks)

    def _sampling_metadata(self, rows: np.ndarray, req_ids: list[str], samples: np.ndarray) -> SamplingMetadata:
        batch = self.input_batch
        greedy = batch.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        num_logprobs = batch.num_logprobs[rows]
        wants_mask = batch.wants_mask[rows] & samples
        use_top_k = bool((top_k < self.vocab_size).any())
        generators = {i: batch.generators[r] for i, r in enumerate(req_ids)
                      if samples[i] and r in batch.generators}
        return SamplingMetadata(
            temperature=None if all_greedy else self._to_device(batch.temperature[rows]),
            all_greedy=all_greedy, all_random=all_random,
            top_p=self._to_device(top_p) if bool((top_p < 1.0).any()) else None,
            top_k=self._to_device(top_k) if use_top_k else None,
            min_p=self._to_device(min_p) if bool((min_p > 0.0).any()) else None,
            generators=generators,
            max_num_logprobs=int(num_logprobs.max()) if bool((num_logprobs >= 0).any()) else None,
            max_top_k=int(top_k.max()),
            sampling_mask_rows=self._to_device(wants_mask.astype(np.int32)) if bool(wants_mask.any()) else None)
