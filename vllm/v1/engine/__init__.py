"""The engine-core protocol: the msgspec structs that cross the frontend <-> engine-core boundary.

Token ids and sampling params go in; new token ids, logprobs, the per-step sampling-mask slice and finish
reasons come out. Text never crosses this boundary.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from vllm.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished; `str()` gives the OpenAI API's spelling."""

    STOP = 0
    LENGTH = 1
    ABORT = 2

    def __str__(self) -> str:
        return ("stop", "length", "abort")[self.value]


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float = 0.0
    # Which frontend (API server process, --api-server-count) sent it: its outputs go back there only.
    client_index: int = 0
    # Prefix caching: blocks are shared only between requests with the same salt (None: unsalted).
    cache_salt: str | None = None
    # Data parallel: the engine core that must serve it (the X-data-parallel-rank header); None: the least loaded.
    data_parallel_rank: int | None = None


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """A request's prompt logprobs (SamplingParams.prompt_logprobs), sent once, with the output of the step that
    computed the last prompt chunk. Row p is prompt token p + 1 (the first prompt token has none): column 0 the
    prompt token itself, then the top k of the raw (unprocessed) log-softmax over the vocabulary."""

    # [num_prompt_tokens - 1, k + 1] int32
    token_ids: np.ndarray
    # [num_prompt_tokens - 1, k + 1] float32
    logprobs: np.ndarray
    # [num_prompt_tokens - 1] int32: the prompt token's rank (1 + the number of tokens with a larger logprob,
    # ties counted as larger, as vLLM).
    ranks: np.ndarray


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    # LogprobsLists for this request's new tokens (vllm.v1.outputs), or None.
    new_logprobs: Any = None
    # SamplingMaskLists slice for this request's new tokens (vllm.v1.outputs), offsets None = one position.
    new_sampling_mask: Any = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # SamplingMaskText slice (the same masks as JSON text) when the API server asked for it, or None.
    new_sampling_mask_text: Any = None
    # The request's whole prompt logprobs, on the output of its first sampling step; None otherwise.
    new_prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    # Sampling-mask sizes of this step's rows and how many overflowed the compact K.
    sampling_mask_sizes: list[int] = msgspec.field(default_factory=list)
    num_sampling_mask_overflow_rows: int = 0
    # Prefix-cache lookups of the requests admitted since the last stats (new requests only, as vLLM's counters):
    # their tokens, and those found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    scheduler_stats: SchedulerStats | None = None
    # Request ids finished inside the core without an output of their own (aborts).
    finished_requests: set[str] | None = None
    # Wire form only (vllm/v1/serial_utils.py): the outputs' logprobs and sampling masks as a few step-level
    # arrays; None in memory on both sides.
    step_arrays: Any = None
    # Engine core only: the step's logprobs and sampling masks with each output's positions
    # (vllm.v1.outputs.StepLogprobs / StepMasks; before `resolve_step_rows`, a PendingStepMasks; in one API
    # server's copy of a step, possibly its StepTextShare), in place of per-output slices; packed into step_arrays
    # on the wire, or `materialize`d for in-process use (`materialize_step_rows`).
    step_logprobs: Any = None
    step_masks: Any = None
    # The weight version (EngineCore.weight_version) of the weights that computed this step's tokens.
    weight_version: str | None = None
    # Sleep mode's news for every API server (vllm/v1/engine/sleep_mode.py): with no outputs, the engine core's
    # sleep state changed to this; True with outputs, these are requests refused because the engine sleeps.
    # None: no news.
    sleeping: bool | None = None
    # Data parallel: the rank of the engine core that sent these outputs (set by its process when it sends them).
    engine_index: int = 0

    def resolve_step_rows(self) -> None:
        """Build deferred sampling masks now (a PendingStepMasks in step_masks) and
        fill in the step's mask statistics; a no-op otherwise. The engine core calls it before it sends or hands
        on these outputs (the next step is already launched)."""
        resolve = getattr(self.step_masks, "resolve", None)
        if resolve is None:
            return
        self.step_masks, sizes, num_overflow = resolve()
        if self.scheduler_stats is not None:
            self.scheduler_stats.sampling_mask_sizes = sizes
            self.scheduler_stats.num_sampling_mask_overflow_rows = num_overflow

    def materialize_step_rows(self) -> None:
        """Move step_logprobs / step_masks into the outputs' own fields (for consumers in the same process)."""
        self.resolve_step_rows()
        for rows in (self.step_logprobs, self.step_masks):
            if rows is not None:
                rows.materialize(self.outputs)
        self.step_logprobs = self.step_masks = None


class EngineCoreRequestType(enum.Enum):
    """Message types from the frontend to the engine-core process (first ZMQ frame)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"


class Deferred:
    """An engine-core utility call's result that is ready only after more steps (EngineCore.pause_generation):
    the caller keeps stepping the engine, sending the outputs as usual, until `ready()`, then takes `result()`."""

    __slots__ = ("ready", "result")

    def __init__(self, ready: Callable[[], bool], result: Callable[[], Any]) -> None:
        self.ready = ready
        self.result = result


class EngineStepError(RuntimeError):
    """A step failed inside a utility call (the steps it drained): fatal for the engine core, as a failed step
    in its loop is, not an error of the call."""
