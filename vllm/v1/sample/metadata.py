"""SamplingMetadata: the batch's sampling settings as tensors, built by the model runner each step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


# The per-row tensor fields, named as the model runner's persistent buffers (InputBuffers) that hold them.
ROW_FIELDS = ("temperature", "top_p", "top_k", "min_p", "sampling_mask_rows", "sampling_mask_group")

# The mask-text group of a graph's padding rows: packed after every real row.
MASK_GROUP_PAD = 1 << 30


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

    def narrow(self, n: int) -> SamplingMetadata:
        """The first n rows (views), e.g. the real rows of a padded decode step."""
        return replace(self, **{f: t[:n] for f in ROW_FIELDS if (t := getattr(self, f)) is not None})
