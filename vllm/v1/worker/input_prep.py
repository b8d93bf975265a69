"""Step input preparation: one step's flat varlen inputs, built in persistent host and device buffers.

Every buffer is a CpuGpuBuffer: a host tensor (pinned on CUDA) with a numpy view that input preparation fills
with vectorised numpy, and a device tensor that receives one non_blocking copy per step. On CPU the two are
the same tensor and nothing is copied.

Invariants:
- The step's requests are taken in the scheduler's order (`SchedulerOutput.num_scheduled_tokens`); request i
  owns flat tokens query_start_loc[i]:query_start_loc[i+1].
- The host buffers are rewritten only after the previous step's copies ran (`prepare` waits on the event it
  records after them), so a step may be prepared while the previous one is still on the device.
- With `pad_to=B` (a pure-decode step run as a CUDA graph of B rows), rows num_reqs..B-1 are padding: one
  token each, input id 0 at position 0, written to the scratch slot, seq_len 1, block-table column 0 = the
  scratch block. Their attention touches only that block, which no request owns.
- With `pad_tokens=T, pad_reqs=R` (a mixed step, prefills and decodes, run at a fixed shape for a CUDA graph of
  T tokens and R request rows), the real requests come first as without padding; then the T - total padding
  tokens belong to padding requests of at most max_model_len tokens each (one, unless T - total exceeds
  max_model_len): input ids 0, positions 0, slots in the scratch block, seq_len = their token count, every
  block-table column = the scratch block. The remaining rows up to R have zero tokens (query_start_loc repeats
  T) and seq_len 0; their block-table rows are neither written nor copied, as a zero-token request's programs
  exit before they read it. The metadata's ints are fixed per (T, R) (`mixed_metadata`), logits_indices are the
  real requests' last tokens.
- A row that sampled in the previous step has that token only on the device: its one scheduled token (the
  newest) takes its input id from the previous step's sampled ids (`apply_prev_sampled`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.cuda_events import host_event
from vllm.v1.worker.input_batch import InputBatch
from vllm.v1.worker.penalty_state import EntryBuffers


class CpuGpuBuffer:
    """A host tensor (+ numpy view) and its device twin; on CPU they are one tensor."""

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cuda = device.type == "cuda"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros(shape, dtype=dtype, device=device) if on_cuda else self.cpu

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device (non_blocking) and return the device view."""
        if self.gpu is self.cpu:
            return self.cpu[:n]
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)


@dataclass(slots=True)
class StepInputs:
    req_ids: list[str]
    # [num_reqs] int64: batch row of each of the step's requests
    rows: np.ndarray
    # [num_reqs] int64
    num_scheduled: np.ndarray
    # [num_reqs] bool: the request's tokens reach its last known token, so it samples
    samples: np.ndarray
    num_actual_tokens: int
    # Rows (and tokens) of a padded pure-decode batch; None otherwise.
    num_padded: int | None
    # Tokens of a padded mixed batch (T; its rows are InputBuffers.max_num_rows or the caller's pad_reqs); None
    # otherwise.
    num_padded_tokens: int | None
    attn_metadata: TritonAttentionMetadata
    # [num_input_tokens] int64 each, on the device (num_input_tokens = num_padded, num_padded_tokens or
    # num_actual_tokens)
    input_ids: torch.Tensor
    positions: torch.Tensor
    # [num_reqs] int64, on the device: the flat row of each request's last token
    logits_indices: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


class InputBuffers:
    """The persistent buffers of step inputs and sampling settings, and the code that fills them."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, max_model_len: int, max_num_blocks_per_req: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        self.device = device
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        # NOTE: one request row more than the scheduler can fill: a padded mixed step of max_num_reqs requests
        # still has a row for its padding tokens.
        self.max_num_rows = max_num_reqs + 1
        buf = lambda *shape, dtype: CpuGpuBuffer(*shape, dtype=dtype, device=device)  # noqa: E731
        self.input_ids = buf(max_num_tokens, dtype=torch.int64)
        self.positions = buf(max_num_tokens, dtype=torch.int64)
        self.slot_mapping = buf(max_num_tokens, dtype=torch.int64)
        self.query_start_loc = buf(self.max_num_rows + 1, dtype=torch.int32)
        self.seq_lens = buf(self.max_num_rows, dtype=torch.int32)
        self.block_table = buf(self.max_num_rows, max_num_blocks_per_req, dtype=torch.int32)
        self.logits_indices = buf(max_num_reqs, dtype=torch.int64)
        # Previous-step sampled ids -> this step's input ids: source index and destination flat row.
        self.prev_src = buf(max_num_reqs, dtype=torch.int64)
        self.prev_dst = buf(max_num_reqs, dtype=torch.int64)
        # Sampling settings, [max_num_reqs] each.
        self.temperature = buf(max_num_reqs, dtype=torch.float32)
        self.top_p = buf(max_num_reqs, dtype=torch.float32)
        self.top_k = buf(max_num_reqs, dtype=torch.int32)
        self.min_p = buf(max_num_reqs, dtype=torch.float32)
        self.sampling_mask_rows = buf(max_num_reqs, dtype=torch.int32)
        self.sampling_mask_group = buf(max_num_reqs, dtype=torch.int32)
        # Penalties (written only for steps with a row that uses penalties or logits processors).
        self.penalty_slot = buf(max_num_reqs, dtype=torch.int64)
        self.penalty_weight = buf(max_num_reqs, dtype=torch.int32)
        self.repetition_penalty = buf(max_num_reqs, dtype=torch.float32)
        self.frequency_penalty = buf(max_num_reqs, dtype=torch.float32)
        self.presence_penalty = buf(max_num_reqs, dtype=torch.float32)
        self.processor_entries = EntryBuffers(device)
        self._arange_np = np.arange(max(max_num_tokens, max_model_len, max_num_reqs) + 1, dtype=np.int64)
        self._copied = host_event() if device.type == "cuda" else None
        # Rows of the last prepared step that take their newest input id from the previous step's sampled ids.
        self._num_cont = 0

    def wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()

    def record_copies(self) -> None:
        if self._copied is not None:
            self._copied.record()

    def prepare(self, batch: InputBatch, so: SchedulerOutput, pad_to: int | None, num_splits: int | None,
                pad_tokens: int | None = None, pad_reqs: int | None = None) -> StepInputs:
        """Fill the buffers for `so` and copy them to the device: padded to `pad_to` rows for a decode step, or to
        `pad_tokens` tokens and `pad_reqs` request rows (default max_num_rows) for any step (num_splits is then
        ignored: 1)."""
        self.wait_for_copies()
        num_reqs = len(so.num_scheduled_tokens)
        req_ids = list(so.num_scheduled_tokens)
        rows = np.fromiter(map(batch.req_id_to_index.__getitem__, req_ids), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int64, count=num_reqs)
        cu = np.cumsum(num_sched)
        total = int(cu[-1])
        if pad_to is not None and (total != num_reqs or pad_to < num_reqs):
            raise ValueError(f"Only a pure-decode step of at most {pad_to} requests can be padded to {pad_to}.")
        if pad_tokens is not None:
            if pad_to is not None:
                raise ValueError("A step is padded either as a decode batch (pad_to) or by tokens (pad_tokens).")
            pad_reqs = self.max_num_rows if pad_reqs is None else pad_reqs
            self._check_mixed_padding(pad_tokens - total, pad_reqs - num_reqs, pad_tokens, pad_reqs)
            num_rows, num_tokens = pad_reqs, pad_tokens
        else:
            num_rows = pad_to if pad_to is not None else num_reqs
            num_tokens = pad_to if pad_to is not None else total

        qsl = self.query_start_loc.np
        qsl[0] = 0
        qsl[1:num_reqs + 1] = cu
        starts = cu - num_sched  # [num_reqs]
        req_indices = np.repeat(rows, num_sched)  # [total] batch row of each token
        computed = batch.num_computed_tokens[rows].astype(np.int64)  # [num_reqs]
        positions = self.positions.np[:total]
        np.add(np.repeat(computed - starts, num_sched), self._arange_np[:total], out=positions)
        self.input_ids.np[:total] = batch.token_ids_cpu[req_indices, positions]
        block_ids = batch.block_table[req_indices, positions // self.block_size].astype(np.int64)
        np.add(block_ids * self.block_size, positions % self.block_size, out=self.slot_mapping.np[:total])
        seq_lens = self.seq_lens.np[:num_reqs]
        np.add(computed, num_sched, out=seq_lens, casting="unsafe")
        np.take(batch.block_table, rows, axis=0, out=self.block_table.np[:num_reqs])
        self.logits_indices.np[:num_reqs] = cu - 1
        samples = seq_lens == batch.num_tokens[rows]  # [num_reqs] bool

        if pad_tokens is not None:
            num_bt_rows = num_reqs + self._fill_mixed_padding(num_reqs, total, num_rows, num_tokens)
        elif num_rows > num_reqs:
            pad = slice(num_reqs, num_rows)
            qsl[num_reqs + 1:num_rows + 1] = total + self._arange_np[1:num_rows - num_reqs + 1]
            self.input_ids.np[pad] = 0
            self.positions.np[pad] = 0
            self.slot_mapping.np[pad] = self.scratch_block * self.block_size
            self.seq_lens.np[pad] = 1
            self.block_table.np[pad, 0] = self.scratch_block

        # Rows that sampled in the previous step: their newest token is the one scheduled now.
        prev_idx = batch.prev_sampled_idx[rows]  # [num_reqs] int32
        newest = batch.num_tokens[rows].astype(np.int64) - 1 - computed  # offset of the newest token
        cont = (prev_idx >= 0) & (newest >= 0) & (newest < num_sched)
        num_cont = int(cont.sum())
        if num_cont:
            self.prev_src.np[:num_cont] = prev_idx[cont]
            self.prev_dst.np[:num_cont] = (starts + newest)[cont]

        input_ids = self.input_ids.copy_to_gpu(num_tokens)
        if pad_tokens is not None:
            for b, n in ((self.query_start_loc, num_rows + 1), (self.seq_lens, num_rows),
                         (self.block_table, num_bt_rows), (self.slot_mapping, num_tokens)):
                b.copy_to_gpu(n)
            md = self.mixed_metadata(num_tokens, num_rows)
        else:
            md = TritonAttentionMetadata(
                num_actual_tokens=num_tokens, num_reqs=num_rows, max_query_len=int(num_sched.max()),
                max_seq_len=int(self.seq_lens.np[:num_rows].max()),
                query_start_loc=self.query_start_loc.copy_to_gpu(num_rows + 1),
                seq_lens=self.seq_lens.copy_to_gpu(num_rows),
                block_table=self.block_table.copy_to_gpu(num_rows),
                slot_mapping=self.slot_mapping.copy_to_gpu(num_tokens),
                query_start_loc_cpu=self.query_start_loc.cpu[:num_rows + 1],
                seq_lens_cpu=self.seq_lens.cpu[:num_rows],
                num_splits=num_splits)
        positions_gpu = self.positions.copy_to_gpu(num_tokens)
        logits_indices = self.logits_indices.copy_to_gpu(num_reqs)
        self._num_cont = num_cont
        if num_cont:
            self.prev_src.copy_to_gpu(num_cont)
            self.prev_dst.copy_to_gpu(num_cont)
        return StepInputs(req_ids=req_ids, rows=rows, num_scheduled=num_sched, samples=samples,
                          num_actual_tokens=total, num_padded=pad_to, num_padded_tokens=pad_tokens, attn_metadata=md,
                          input_ids=input_ids, positions=positions_gpu, logits_indices=logits_indices)

    def apply_prev_sampled(self, prev_sampled: torch.Tensor | None) -> None:
        """Scatter the previous step's sampled ids ([num_prev] int64, device) into this step's input ids."""
        n = self._num_cont
        if n == 0:
            return
        assert prev_sampled is not None, "a row continues from a step whose sampled ids were dropped"
        src, dst = self.prev_src.gpu[:n], self.prev_dst.gpu[:n]
        self.input_ids.gpu.index_copy_(0, dst, prev_sampled.index_select(0, src).to(torch.int64))

    def fill_dummy_decode(self, num_rows: int) -> None:
        """Inputs of a decode batch made only of padding rows (CUDA-graph warm-up and capture)."""
        self.wait_for_copies()
        self.query_start_loc.np[:num_rows + 1] = self._arange_np[:num_rows + 1]
        self.input_ids.np[:num_rows] = 0
        self.positions.np[:num_rows] = 0
        self.slot_mapping.np[:num_rows] = self.scratch_block * self.block_size
        self.seq_lens.np[:num_rows] = 1
        self.block_table.np[:num_rows, 0] = self.scratch_block
        for b, n in ((self.input_ids, num_rows), (self.positions, num_rows), (self.slot_mapping, num_rows),
                     (self.query_start_loc, num_rows + 1), (self.seq_lens, num_rows), (self.block_table, num_rows)):
            b.copy_to_gpu(n)
        self.record_copies()

    def decode_metadata(self, num_rows: int, num_splits: int | None, max_seq_len: int) -> TritonAttentionMetadata:
        """Metadata over the device buffers for a decode batch of num_rows rows (what a CUDA graph captures)."""
        return TritonAttentionMetadata(
            num_actual_tokens=num_rows, num_reqs=num_rows, max_query_len=1, max_seq_len=max_seq_len,
            query_start_loc=self.query_start_loc.gpu[:num_rows + 1], seq_lens=self.seq_lens.gpu[:num_rows],
            block_table=self.block_table.gpu[:num_rows], slot_mapping=self.slot_mapping.gpu[:num_rows],
            query_start_loc_cpu=self.query_start_loc.cpu[:num_rows + 1], seq_lens_cpu=self.seq_lens.cpu[:num_rows],
            num_splits=num_splits)

    def _check_mixed_padding(self, num_pad_tokens: int, num_pad_rows: int, num_tokens: int, num_rows: int) -> None:
        if num_pad_tokens < 0 or num_pad_rows < 0 or num_rows > self.max_num_rows:
            raise ValueError(f"A step padded to {num_tokens} tokens and {num_rows} rows has more tokens or requests, "
                             f"or the rows exceed {self.max_num_rows}.")
        if num_pad_rows * self.max_model_len < num_pad_tokens:
            raise ValueError(f"{num_pad_tokens} padding tokens do not fit in {num_pad_rows} padding requests of at "
                             f"most {self.max_model_len} tokens.")

    def _fill_mixed_padding(self, first_row: int, first_token: int, num_rows: int, num_tokens: int) -> int:
        """Padding requests at rows first_row.. for tokens first_token:num_tokens (at most max_model_len tokens
        each), then zero-token rows up to num_rows; returns the number of padding requests with tokens (their
        block-table rows are written, and must be copied)."""
        n = num_tokens - first_token
        cap = self.max_model_len
        num_full, rest = divmod(n, cap)
        lens = [cap] * num_full + ([rest] if rest else [])  # tokens of each padding request
        k = len(lens)
        qsl = self.query_start_loc.np
        qsl[first_row + 1:first_row + 1 + k] = first_token + np.cumsum(lens, dtype=np.int64)
        qsl[first_row + 1 + k:num_rows + 1] = num_tokens
        self.seq_lens.np[first_row:first_row + k] = lens
        self.seq_lens.np[first_row + k:num_rows] = 0
        self.block_table.np[first_row:first_row + k] = self.scratch_block
        pad = slice(first_token, num_tokens)
        self.input_ids.np[pad] = 0
        # NOTE: positions only feed the rotary embedding (attention takes a query's position from seq_lens), and 0
        # is inside every rotary cache; the slot of a padding request's token t is the scratch block's t % block_size,
        # where the block table says its key is.
        self.positions.np[pad] = 0
        self.slot_mapping.np[pad] = self.scratch_block * self.block_size + self._arange_np[:n] % cap % self.block_size
        return k

    def fill_dummy_mixed(self, num_tokens: int, num_rows: int) -> None:
        """Inputs of a mixed batch of num_tokens tokens and num_rows rows made only of padding (what a mixed CUDA
        graph would be warmed up and captured on)."""
        self.wait_for_copies()
        self._check_mixed_padding(num_tokens, num_rows, num_tokens, num_rows)
        self.query_start_loc.np[0] = 0
        k = self._fill_mixed_padding(0, 0, num_rows, num_tokens)
        for b, n in ((self.input_ids, num_tokens), (self.positions, num_tokens), (self.slot_mapping, num_tokens),
                     (self.query_start_loc, num_rows + 1), (self.seq_lens, num_rows), (self.block_table, k)):
            b.copy_to_gpu(n)
        self.record_copies()

    def mixed_metadata(self, num_tokens: int, num_rows: int) -> TritonAttentionMetadata:
        """Metadata over the device buffers for a step padded to num_tokens tokens and num_rows rows. Its ints are
        fixed per (num_tokens, num_rows), as a CUDA graph captures them: max_query_len = num_tokens (> 1, so the
        unified kernel takes its prefill tile, BLOCK_M 64, for every mixed batch), max_seq_len = max_model_len,
        one KV split."""
        return TritonAttentionMetadata(
            num_actual_tokens=num_tokens, num_reqs=num_rows, max_query_len=max(num_tokens, 2),
            max_seq_len=self.max_model_len, query_start_loc=self.query_start_loc.gpu[:num_rows + 1],
            seq_lens=self.seq_lens.gpu[:num_rows], block_table=self.block_table.gpu[:num_rows],
            slot_mapping=self.slot_mapping.gpu[:num_tokens],
            query_start_loc_cpu=self.query_start_loc.cpu[:num_rows + 1], seq_lens_cpu=self.seq_lens.cpu[:num_rows],
            num_splits=1)

    def sampling_tensor(self, buffer: CpuGpuBuffer, values: np.ndarray) -> torch.Tensor:
        n = len(values)
        buffer.np[:n] = values
        return buffer.copy_to_gpu(n)
