"""SamplingMetadata: the batch's sampling settings as tensors, built by the model runner each step.

Penalties and logits processors (ops/penalties.py) come as `LogitsProcessorTensors` plus five per-row fields; all
are None when no row of the step uses one, and the sampler then runs exactly as without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


# The per-row tensor fields, named as the model runner's persistent buffers (InputBuffers) that hold them.
ROW_FIELDS = ("temperature", "top_p", "top_k", "min_p", "sampling_mask_rows", "sampling_mask_group",
              "penalty_slot", "penalty_weight", "repetition_penalty", "frequency_penalty", "presence_penalty")

# The mask-text group of a graph's padding rows: packed after every real row.
MASK_GROUP_PAD = 1 << 30


@dataclass(slots=True)
class LogitsProcessorTensors:
    """The step's sparse processor entries (views of persistent buffers, padded to bucketed lengths) and the
    penalty state pool (vllm/v1/worker/penalty_state.py). Entry rows are the step's row indices."""
    # [num_slots, V] int32: output count | PROMPT_BIT per (slot, token); the last slot is the all-zero scratch.
    state: torch.Tensor
    # [num_slots, W] int32: each slot's last W output tokens, -1 before the first.
    recent: torch.Tensor
    # logit_bias, min_tokens bans, single-token bad words: [E] int64 rows, int64 ids, float32 values (or None).
    bias_rows: torch.Tensor | None = None
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    # allowed_token_ids: [A] int64 rows and ids (see ops/penalties.apply_allowed), or None.
    allowed_rows: torch.Tensor | None = None
    allowed_ids: torch.Tensor | None = None
    # Multi-token bad words: [B] int64 rows, [B, W] int64 right-aligned prefixes, [B] int64 banned ids, or None.
    bad_rows: torch.Tensor | None = None
    bad_prefixes: torch.Tensor | None = None
    bad_last_ids: torch.Tensor | None = None
    # Whether any row has a repetition, frequency or presence penalty.
    any_penalty: bool = False

    def graph_key(self) -> tuple[object, ...]:
        """What a captured sampler graph depends on besides the buffers' contents: every tensor's address and
        shape (a grown pool or another entry bucket is another graph), and whether penalties run."""
        tensors = (self.state, self.recent, self.bias_rows, self.bias_ids, self.bias_values, self.allowed_rows,
                   self.allowed_ids, self.bad_rows, self.bad_prefixes, self.bad_last_ids)
        return (self.any_penalty, *((None if t is None else (t.data_ptr(), tuple(t.shape))) for t in tensors))


@dataclass(slots=True)
class SamplingMetadata:
    # [num_reqs] float32; None when every row is greedy. Greedy rows hold 0.0 (the sampler divides them by 1.0).
    temperature: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [num_reqs] float32, 1.0 where disabled; None when no row uses top-p.
    top_p: torch.Tensor | None
    # [num_reqs] int32, vocab_size where disabled; None when no row uses top-k.
    top_k: torch.Tensor | None
    # [num_reqs] float32, 0.0 where disabled; None when no row uses min-p.
    min_p: torch.Tensor | None
    # row -> generator, for seeded rows that sample this step (only those draw random numbers from it).
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest `logprobs` in the batch; None when no row asks for logprobs.
    max_num_logprobs: int | None = None
    # Largest top_k in the batch (the compact width of the sampling mask); vocab_size when some row has none.
    max_top_k: int = 0
    # [num_reqs] int32: 1 for rows whose sampling mask is wanted this step, 0 otherwise (the num_sampled of
    # SamplingMaskTensors.from_logits); None when no row wants a mask.
    sampling_mask_rows: torch.Tensor | None = None
    # [num_reqs] int32: the group of each row's sampling-mask JSON text (its API server, `client_index`), when
    # the texts are made: the packed text holds each group's rows together (in row order), so each API server is
    # sent one contiguous span of its own rows. Padding rows hold MASK_GROUP_PAD (after every group). None: no
    # text, or rows in batch order. The sampler itself does not read it.
    sampling_mask_group: torch.Tensor | None = None
    # Penalties and logits processors; every field None when no row of the step uses one.
    processors: LogitsProcessorTensors | None = None
    # [num_reqs] int64: each row's slot in processors.state (the scratch slot when it has none).
    penalty_slot: torch.Tensor | None = None
    # [num_reqs] int32: 1 where the sampled token is counted into the row's slot (it samples and owns a slot).
    penalty_weight: torch.Tensor | None = None
    # [num_reqs] float32 each: 1.0, 0.0, 0.0 where off.
    repetition_penalty: torch.Tensor | None = None
    frequency_penalty: torch.Tensor | None = None
    presence_penalty: torch.Tensor | None = None

    def narrow(self, n: int) -> SamplingMetadata:
        """The first n rows (views), e.g. the real rows of a padded decode step."""
        return replace(self, **{f: t[:n] for f in ROW_FIELDS if (t := getattr(self, f)) is not None})
