"""ModelRunner: turns a SchedulerOutput into one forward pass plus sampling, and returns ModelRunnerOutput.

Each step is flattened into varlen metadata with vectorised numpy over the persistent InputBatch, in persistent
host/device buffers (input_prep.py): request i's scheduled tokens are rows query_start_loc[i]:query_start_loc[i+1]
of the flat batch. Only rows whose scheduled tokens reach the end of their known tokens sample; a partial prefill
chunk produces no token, no logprobs and an empty sampling-mask row.

Step shape: prepare inputs (H2D copies) -> forward (a CUDA graph for pure-decode steps, and for mixed
steps padded to a captured token count, cudagraph.py) -> logits
-> sampler (with the logits and the mask's host-copy packing, a second CUDA graph for those steps) -> outputs
start their way to the host (async_output.py). `execute_model_async` returns before the outputs are on the host;
the sampled ids stay on the device and feed the next step's input ids directly, so the next step can be launched
first.

Invariants:
- The KV cache has one block more than the scheduler knows of (index num_blocks): the scratch block that the
  padding rows of a CUDA-graph batch write to and read from.
- A graphed decode step samples all B padded rows: the padding rows get neutral settings (temperature 1, top_k
  = the batch's max_top_k, no top-p/min-p, no mask) and their outputs are cut off; the sampler's fallback rows
  are chosen real rows first (stable order), so padding can never take a fallback slot from a real row.
- A mixed step padded to T tokens (a mixed CUDA graph's size, or pad_eager_mixed in tests) runs its forward
  over all T tokens and max_num_seqs + 1 request rows; its logits and sampler run on the real requests' last
  tokens only, as an unpadded step's do (as a sampler graph, below, or eagerly).
- A step with prefills (mixed graph or eager forward, num_reqs <= the largest
  capture size, at least one request sampling) samples the same way: its requests' last hidden states, then
  zero rows, go into the decode forward graph's static output of B = the padded request count, and the sampler
  graph of B runs over them; rows that do not sample this step (partial prefill chunks) are sampled too and
  dropped, as in the eager sampler.
- A sampled token is counted in InputBatch.num_tokens when it is sampled; its value reaches token_ids_cpu when
  its step's output is read back (`get_output()`), which the engine does before it schedules two steps later.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
import torch

from vllm.config import VllmConfig
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model
from vllm.v1.attention.backends.abstract import AttentionMetadata
from vllm.v1.attention.ops.triton_unified_attention import num_splits_for_cudagraph
from vllm.v1.attention.layer import set_attn_backend
from vllm.v1.attention.selector import get_attn_backend
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, LogprobsTensors, ModelRunnerOutput, StepRowSettings
from vllm.v1.sample.metadata import MASK_GROUP_PAD, ROW_FIELDS, SamplingMetadata
from vllm.v1.sample.fast_path import fast_path_applies
from vllm.v1.sample.sampler import Sampler, SamplerOutput, count_sampled
from vllm.v1.sample.sampling_mask import SamplingMaskTensors, mask_ids_needed
from vllm.v1.worker.async_output import AsyncModelRunnerOutput, AsyncOutputCopier
from vllm.v1.worker.cudagraph import (CudaGraphManager, SamplerGraphs, resolve_capture_sizes,
                                      resolve_mixed_capture_sizes)
from vllm.v1.worker.input_batch import InputBatch
from vllm.v1.worker.input_prep import InputBuffers, StepInputs
from vllm.v1.worker.prompt_logprobs import PromptLogprobsComputer, WithPromptLogprobs
from vllm.v1.worker.penalty_state import step_penalty_fields

logger = logging.getLogger(__name__)


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
        self.hidden_size = int(mc.hf_config.hidden_size)
        self.num_kv_heads = mc.get_num_kv_heads(vllm_config.parallel_config)  # this rank's (tensor parallel)
        self.head_size = mc.head_size
        self.return_sampling_mask = mc.return_sampling_mask

        torch.manual_seed(mc.seed)
        self.model = get_model(mc, self.device, self.dtype)
        self.attn_backend = get_attn_backend(self.device)
        set_attn_backend(self.model, self.attn_backend)
        self.sampler = Sampler(mc.logprobs_mode)
        self.max_num_blocks_per_req = -(-self.max_model_len // self.block_size)
        self.input_batch = InputBatch(self.max_num_reqs, self.max_model_len, self.max_num_blocks_per_req,
                                      self.vocab_size, self.device, self.return_sampling_mask)
        self.kv_caches: list[torch.Tensor] = []
        self.input_buffers = InputBuffers(self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                                          self.max_num_blocks_per_req, self.block_size, 0, self.device)
        self.cudagraphs = CudaGraphManager(resolve_capture_sizes(
            mc.cudagraph_capture_sizes, self.max_num_reqs, self.max_num_tokens))
        self.use_cuda_graph = (self.device.type == "cuda" and not mc.enforce_eager
                               and self.attn_backend.name == "TRITON")
        # NOTE: tests set this to run decode steps padded exactly as for a CUDA graph, but eagerly (e.g. on CPU).
        self.pad_eager_decode = False
        # Forward graphs of mixed steps (prefills among decodes), padded to the smallest size that holds their
        # tokens and to max_num_seqs + 1 rows; captured with CUDA graphs (use_mixed_cuda_graph).
        self.mixed_graphs = CudaGraphManager(
            resolve_mixed_capture_sizes(None, self.max_num_tokens, self.max_model_len, self.max_num_reqs), kind="mixed")
        # NOTE: a test-only hook: tests set it False to capture the decode sizes alone.
        self.capture_mixed_graphs = True
        # [largest mixed size, hidden_size]: the hidden states every mixed graph writes (allocated at capture).
        self._mixed_hidden: torch.Tensor | None = None
        # What profile_mixed_graph_memory() kept out of the KV cache for them (logged at capture).
        self.mixed_graph_bytes = 0
        # NOTE: tests set this to run mixed steps padded exactly as for a mixed graph, but eagerly (e.g. on CPU).
        self.pad_eager_mixed = False
        # Steps with prefills sample as sampler graphs (module docstring); tests set it False to sample them eagerly.
        self.sample_mixed_graphed = True
        # Logits + sampler of graphed decode steps; tests that wrap the sampler set it to None, or to
        # SamplerGraphs(capture=False) to run the padded sampler eagerly.
        self.sampler_graphs: SamplerGraphs | None = (
            SamplerGraphs(self.cudagraphs.capture_sizes) if self.use_cuda_graph else None)
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        mask_text = mc.return_sampling_mask and mc.sampling_mask_text
        mask_ids = mask_ids_needed(mask_text, self.vocab_size)
        self.output_copier = AsyncOutputCopier(self.device, use_thread=self.async_scheduling, mask_text=mask_text,
                                               mask_ids=mask_ids)
        # [num_reqs of the previous sampling step] int64, on the device
        self._prev_sampled: torch.Tensor | None = None
        # The requests that asked for prompt logprobs, until their prompt is computed (prompt_logprobs.py).
        self.prompt_logprobs = PromptLogprobsComputer(self.vocab_size, self.device)
        # Tensor parallelism: only the driver's (rank 0's) outputs are read; the other ranks sample the same tokens
        # and copy only their ids to the host (vllm/v1/executor/distributed.py). Set by the worker.
        self.is_driver_worker = True

    # ---- KV cache -------------------------------------------------------------------------------------------

    def kv_cache_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_size * elem * self.num_layers

    def initialize_kv_cache(self, num_blocks: int,
                            allocate: Callable[[tuple[int, ...], torch.dtype, int], list[torch.Tensor]] | None = None
                            ) -> None:
        """num_blocks blocks for requests plus the scratch block (index num_blocks) for padding rows; `allocate`
        (sleep mode's, vllm/v1/worker/sleep.py) makes the zeroed per-layer tensors instead of torch.zeros."""
        shape = (2, num_blocks + 1, self.block_size, self.num_kv_heads, self.head_size)
        if allocate is not None:
            self.kv_caches = allocate(shape, self.dtype, self.num_layers)
        else:
            self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                              for _ in range(self.num_layers)]
        self.input_buffers.scratch_block = num_blocks

    def _graph_num_splits(self, num_rows: int) -> int | None:
        if self.attn_backend.name != "TRITON":
            return None
        return num_splits_for_cudagraph(num_rows, self.max_model_len, self.num_kv_heads)

    @property
    def use_mixed_cuda_graph(self) -> bool:
        """Mixed steps are padded and replayed as graphs: CUDA graphs are on (CUDA, not enforce_eager, the Triton
        backend), unless a test turned capture_mixed_graphs off."""
        return self.use_cuda_graph and self.capture_mixed_graphs

    @torch.inference_mode()
    def capture_model(self) -> None:
        """Capture the CUDA graphs (after the KV cache exists): the mixed sizes first when use_mixed_cuda_graph,
        then the decode sizes into the same pool; a no-op when graphs are off."""
        if not self.use_cuda_graph:
            return
        buffers = self.input_buffers
        pool = None
        mixed = self.use_mixed_cuda_graph and bool(self.mixed_graphs.capture_sizes)
        if mixed:
            free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
            self._mixed_hidden = torch.empty((self.mixed_graphs.capture_sizes[-1], self.hidden_size),
                                             dtype=self.dtype, device=self.device)
            self.mixed_graphs.capture(self._mixed_forward, lambda t: buffers.fill_dummy_mixed(t, buffers.max_num_rows),
                                      release_warmup_memory=True)
            pool = self.mixed_graphs.pool
        if self.cudagraphs.capture_sizes:
            self.cudagraphs.capture(self._decode_forward, buffers.fill_dummy_decode, pool)
        if mixed and self.device.type == "cuda":
            torch.cuda.empty_cache()
            used = free_before - torch.cuda.mem_get_info(self.device)[0]
            logger.info("CUDA graphs (mixed and decode) hold %.2f GiB; %.2f GiB was kept out of the KV cache for "
                        "them", used / (1 << 30), self.mixed_graph_bytes / (1 << 30))

    def _decode_forward(self, num_rows: int) -> torch.Tensor:
        """What the decode graph of num_rows rows runs: the model on the buffers' first num_rows rows."""
        buffers = self.input_buffers
        md = buffers.decode_metadata(num_rows, self._graph_num_splits(num_rows), self.max_model_len)
        with set_forward_context(md, self.kv_caches):
            return self.model(buffers.input_ids.gpu[:num_rows], buffers.positions.gpu[:num_rows])

    def _mixed_forward(self, num_tokens: int) -> torch.Tensor:
        """What the mixed graph of num_tokens tokens runs: the model on the buffers' first num_tokens tokens and
        all max_num_rows rows; returns the first num_tokens rows of the output shared by every mixed size."""
        buffers = self.input_buffers
        assert self._mixed_hidden is not None
        with set_forward_context(buffers.mixed_metadata(num_tokens, buffers.max_num_rows), self.kv_caches):
            hidden = self.model(buffers.input_ids.gpu[:num_tokens], buffers.positions.gpu[:num_tokens])
        # NOTE: one output for every size (a copy of ~T * hidden elements per step) instead of one per size, which
        # would hold the hidden states of every multiple of 256 up to the token budget.
        return self._mixed_hidden[:num_tokens].copy_(hidden)

    @torch.inference_mode()
    def profile_mixed_graph_memory(self) -> int:
        """Bytes the mixed graphs will hold besides the eager peak of profile_run: the activations of a forward of
        the largest mixed size (the graph pool, which the decode graphs then share) and the shared output; 0 when
        mixed graphs are off. CUDA only; resets the device's peak-memory stats, so call it after that peak was
        read."""
        if not self.use_mixed_cuda_graph or not self.mixed_graphs.capture_sizes:
            return 0
        num_tokens = self.mixed_graphs.capture_sizes[-1]
        buffers = self.input_buffers
        self.initialize_kv_cache(0)  # the scratch block only: a padding-only step touches nothing else
        buffers.fill_dummy_mixed(num_tokens, buffers.max_num_rows)
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with set_forward_context(buffers.mixed_metadata(num_tokens, buffers.max_num_rows), self.kv_caches):
            self.model(buffers.input_ids.gpu[:num_tokens], buffers.positions.gpu[:num_tokens])
        torch.cuda.synchronize(self.device)
        activations = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_caches = []
        self.mixed_graph_bytes = activations + num_tokens * self.hidden_size * self.dtype.itemsize
        return self.mixed_graph_bytes

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
        logits = self.model.compute_logits(hidden[idx])  # the model's dtype, as in a real step
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
            self.prompt_logprobs.remove(req_id)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)  # resumed after preemption: its old row is stale
            batch.add_request(new)
            self.prompt_logprobs.add(new.req_id, new.sampling_params, new.prompt_token_ids,
                                     len(new.output_token_ids))
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            row = batch.req_id_to_index[req_id]
            batch.num_computed_tokens[row] = num_computed
            if new_blocks:
                batch.append_block_ids(row, new_blocks)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_model_async(so).get_output()

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch one step; the returned object's `get_output()` waits for its host-side results."""
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return AsyncModelRunnerOutput.ready(EMPTY_MODEL_RUNNER_OUTPUT)
        num_reqs = len(so.num_scheduled_tokens)
        pad_to = None
        if so.total_num_scheduled_tokens == num_reqs and (self.use_cuda_graph or self.pad_eager_decode):
            pad_to = self.cudagraphs.padded_size(num_reqs)
        pad_tokens = None
        if so.total_num_scheduled_tokens != num_reqs and (self.pad_eager_mixed or self.use_mixed_cuda_graph):
            pad_tokens = self.mixed_graphs.padded_size(so.total_num_scheduled_tokens)
        buffers = self.input_buffers
        inputs = buffers.prepare(self.input_batch, so, pad_to,
                                 self._graph_num_splits(pad_to) if pad_to is not None else None, pad_tokens)
        buffers.apply_prev_sampled(self._prev_sampled)
        graph_rows = pad_to if pad_to is not None and self.sampler_graphs is not None else None
        # A step with prefills (no forward graph) samples as the sampler graph of its padded request count, over
        # its requests' last hidden states.
        # NOTE: not for a step where no request samples (only partial prompt chunks): its settings (no mask rows)
        # would make a sampler-graph key of their own, captured at every size for a step whose draws are dropped.
        mixed_rows = None
        if (pad_to is None and self.sample_mixed_graphed and self.sampler_graphs is not None
                and (self.use_cuda_graph or self.pad_eager_decode) and bool(inputs.samples.any())):
            mixed_rows = self.cudagraphs.padded_size(num_reqs)
        sample_rows = graph_rows or mixed_rows
        meta = self._sampling_metadata(inputs, sample_rows)
        buffers.record_copies()
        hidden, out = None, None
        if sample_rows is not None and self._sampler_graphable(meta, sample_rows):
            hidden = self._forward_rows(inputs)  # [graph_rows or the step's tokens, hidden_size]
            if mixed_rows is not None:
                out = self._sample_graphed(meta, mixed_rows,
                                           self._padded_last_hidden(hidden[inputs.logits_indices], mixed_rows))
            else:
                out = self._sample_graphed(meta, sample_rows, hidden)
        if out is None:
            if sample_rows is not None:
                meta = meta.narrow(num_reqs)
            if hidden is None:
                hidden = self._forward_rows(inputs)
            last = hidden[:num_reqs] if inputs.num_padded is not None else hidden[inputs.logits_indices]
            logits = self.model.compute_logits(last)  # [num_reqs, V], the model's dtype (the sampler converts)
            out = self._with_text_group(self.sampler(logits, meta), meta)
        else:
            out = _narrow_output(out, num_reqs)
        plp = None
        if self.prompt_logprobs.requests:
            plp = self.prompt_logprobs.compute(inputs.req_ids, self.input_batch.num_computed_tokens[inputs.rows],
                                               inputs.num_scheduled, hidden, self.model.compute_logits)
        if meta.processors is not None:
            count_sampled(meta.narrow(num_reqs), out.sampled_token_ids)
        result = self._finish_step(inputs, out)
        if plp is not None:
            result = WithPromptLogprobs(result, plp)  # type: ignore[assignment]
        return result

    def _sampler_graphable(self, meta: SamplingMetadata, rows: int) -> bool:
        """Whether this padded step's logits + sampler can run as a sampler graph: not for seeded rows or the
        general path, and only over a captured forward (or the tests' padded eager forward)."""
        if meta.generators or not fast_path_applies(meta, self.vocab_size):
            return False
        return (self.use_cuda_graph and rows in self.cudagraphs.graphs) or self.pad_eager_decode

    def _sample_graphed(self, meta: SamplingMetadata, rows: int, hidden: torch.Tensor) -> SamplerOutput | None:
        """The logits + sampler graph over all `rows` padded rows of `hidden` (the forward's static output), or
        None when the sampler graphs cannot take this step's settings (the caller samples eagerly)."""
        assert self.sampler_graphs is not None
        key = (meta.all_greedy, meta.all_random, meta.temperature is None, meta.top_p is None, meta.min_p is None,
               meta.max_num_logprobs, meta.max_top_k, meta.sampling_mask_rows is None,
               None if meta.processors is None else meta.processors.graph_key())

        def make_fn(size: int) -> Callable[[], SamplerOutput]:
            # NOTE: what a graph of `size` rows reads: that size's forward output and the buffers' first rows.
            static_hidden = self.cudagraphs.graphs[size][1] if size != rows else hidden
            static_meta = self._padded_metadata(meta).narrow(size)
            return lambda: self._sample_prepacked(self.model.compute_logits(static_hidden), static_meta)

        return self.sampler_graphs.run(rows, key, make_fn)

    def _padded_last_hidden(self, last: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, hidden_size]: the requests' last hidden states `last`, then zero rows, in the tensor that the
        sampler graph of `rows` reads: the decode forward graph's static output of that size (which nothing else
        writes before the next forward), or a new tensor for the tests' padded eager steps."""
        n = last.shape[0]
        if self.use_cuda_graph and rows in self.cudagraphs.graphs:
            padded = self.cudagraphs.graphs[rows][1]
        else:
            padded = torch.empty((rows, last.shape[1]), dtype=last.dtype, device=last.device)
        padded[:n].copy_(last)
        padded[n:].zero_()
        return padded

    def _sample_prepacked(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """The sampler, and the mask's host-copy layout (SamplingMaskTensors.prepack) in the same graph."""
        out = self.sampler(logits, meta)
        mask = out.sampling_mask
        if isinstance(mask, SamplingMaskTensors):
            copier = self.output_copier
            out = replace(out, sampling_mask=mask.prepack(copier.mask_text, meta.sampling_mask_group,
                                                          with_ids=copier.mask_ids))
        return out

    @staticmethod
    def _with_text_group(out: SamplerOutput, meta: SamplingMetadata) -> SamplerOutput:
        """An eager step's mask with its text's row groups (each row's API server), which the copy stream's JSON
        kernels then pack by group, as `prepack` does in the graphs."""
        mask = out.sampling_mask
        if isinstance(mask, SamplingMaskTensors) and meta.sampling_mask_group is not None:
            out = replace(out, sampling_mask=mask.with_text_group(meta.sampling_mask_group))
        return out

    def _forward_rows(self, inputs: StepInputs) -> torch.Tensor:
        """Hidden states of every row of the step's inputs: [num_padded, num_padded_tokens or num_actual_tokens,
        hidden_size] (a captured graph's static output for a padded step of a captured size)."""
        if inputs.num_padded is not None and self.use_cuda_graph and inputs.num_padded in self.cudagraphs.graphs:
            return self.cudagraphs.replay(inputs.num_padded)
        num_tokens = inputs.num_padded_tokens
        if num_tokens is not None and self.use_mixed_cuda_graph and num_tokens in self.mixed_graphs.graphs:
            return self.mixed_graphs.replay(num_tokens)
        with set_forward_context(inputs.attn_metadata, self.kv_caches):
            return self.model(inputs.input_ids, inputs.positions)

    def _finish_step(self, inputs: StepInputs, out: SamplerOutput) -> AsyncModelRunnerOutput:
        batch = self.input_batch
        sample_idx = np.flatnonzero(inputs.samples)  # [num_sampled] index into the step's requests
        sample_rows = inputs.rows[sample_idx]
        positions = batch.num_tokens[sample_rows].astype(np.int64)
        # Count each sampled token now; its value reaches token_ids_cpu in _write_sampled.
        batch.num_tokens[sample_rows] += 1
        batch.prev_sampled_idx[:batch.num_reqs] = -1
        batch.prev_sampled_idx[sample_rows] = sample_idx
        self._prev_sampled = out.sampled_token_ids
        req_ids = inputs.req_ids
        sampled_req_ids = [req_ids[i] for i in sample_idx.tolist()]
        on_ready = partial(self._write_sampled, sampled_req_ids, positions, sample_idx)
        if not self.is_driver_worker:  # NOTE: its outputs are dropped: no logprobs or masks to the host
            return self.output_copier.submit(req_ids, inputs.samples, out.sampled_token_ids, None, None, on_ready)
        rows = inputs.rows
        row_settings = StepRowSettings(batch.num_logprobs[rows] >= 0, batch.wants_mask[rows], batch.top_k[rows])
        return self.output_copier.submit(req_ids, inputs.samples, out.sampled_token_ids, out.logprobs_tensors,
                                         out.sampling_mask, on_ready, row_settings)

    def _write_sampled(self, req_ids: list[str], positions: np.ndarray, sample_idx: np.ndarray,
                       sampled: np.ndarray) -> None:
        """Record a step's sampled token values in the rows still holding their requests."""
        batch = self.input_batch
        index = batch.req_id_to_index
        rows = np.fromiter((index.get(r, -1) for r in req_ids), dtype=np.int64, count=len(req_ids))
        ok = (rows >= 0) & (positions < self.max_model_len)
        batch.token_ids_cpu[rows[ok], positions[ok]] = sampled[sample_idx[ok]]

    def _padded_metadata(self, meta: SamplingMetadata) -> SamplingMetadata:
        """`meta` over all max_num_reqs rows of the persistent buffers (what a sampler graph of any size reads)."""
        return replace(meta, **{f: getattr(self.input_buffers, f).gpu for f in ROW_FIELDS
                                if getattr(meta, f) is not None})

    def _sampling_metadata(self, inputs: StepInputs, pad_to: int | None = None) -> SamplingMetadata:
        """The step's sampling settings; with `pad_to`, tensors of pad_to rows whose padding rows are neutral."""
        batch, buffers = self.input_batch, self.input_buffers
        rows, samples = inputs.rows, inputs.samples
        greedy = batch.greedy[rows]
        all_greedy, all_random = bool(greedy.all()), not bool(greedy.any())
        top_k, top_p, min_p = batch.top_k[rows], batch.top_p[rows], batch.min_p[rows]
        num_logprobs = batch.num_logprobs[rows]
        wants_mask = batch.wants_mask[rows] & samples
        any_mask = bool(wants_mask.any())
        seeded = np.flatnonzero(batch.seeded[rows] & samples)
        generators = {i: batch.generators[inputs.req_ids[i]] for i in seeded.tolist()}
        max_top_k = int(top_k.max())
        pad = 0 if pad_to is None else pad_to - len(rows)

        def tensor(buffer: Any, values: np.ndarray, neutral: float | int) -> torch.Tensor:
            if pad:
                values = np.concatenate([values, np.full(pad, neutral, dtype=values.dtype)])
            return buffers.sampling_tensor(buffer, values)

        penalty_fields = step_penalty_fields(batch, inputs.req_ids, rows, samples, buffers, tensor, self.vocab_size)
        return SamplingMetadata(
            **penalty_fields,
            temperature=None if all_greedy else tensor(buffers.temperature, batch.temperature[rows], 1.0),
            all_greedy=all_greedy, all_random=all_random,
            top_p=tensor(buffers.top_p, top_p, 1.0) if bool((top_p < 1.0).any()) else None,
            top_k=tensor(buffers.top_k, top_k, max_top_k) if bool((top_k < self.vocab_size).any()) else None,
            min_p=tensor(buffers.min_p, min_p, 0.0) if bool((min_p > 0.0).any()) else None,
            generators=generators,
            max_num_logprobs=int(num_logprobs.max()) if bool((num_logprobs >= 0).any()) else None,
            max_top_k=max_top_k,
            sampling_mask_rows=tensor(buffers.sampling_mask_rows, wants_mask, False) if any_mask else None,
            # The JSON texts of the masks (API servers) go packed by API server: one span of the step each.
            sampling_mask_group=tensor(buffers.sampling_mask_group, batch.client_index[rows], MASK_GROUP_PAD)
            if any_mask and self.output_copier.mask_text else None)


def _narrow_output(out: SamplerOutput, n: int) -> SamplerOutput:
    """The first n rows of a padded step's sampler output (views of the graph's static tensors)."""
    logprobs = None if out.logprobs_tensors is None else LogprobsTensors(*(t[:n] for t in out.logprobs_tensors))
    mask = out.sampling_mask
    return SamplerOutput(out.sampled_token_ids[:n], logprobs, None if mask is None else mask.narrow(n))
