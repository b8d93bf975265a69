"""Sleep mode in the engine core (vLLM's `sleep(level, mode)` / `wake_up(tags)` / `is_sleeping()`), between steps,
as utility calls; the memory itself is the worker's (vllm/v1/worker/sleep.py).

- `sleep(level, mode)`: the requests in the engine are handled by `mode`, as a pause's: "abort" (default) ends
  them now (finish_reason "abort"); "wait" lets them finish first (the call returns then); "keep" preempts them
  (their KV blocks are freed; they are recomputed from their tokens after the wake, and go on). Then the
  prefix cache is reset and, for levels 1 and 2, the worker releases the weights' and the KV cache's memory
  (level 1: weights kept on the host; level 2: discarded). Level 0 only stops scheduling (no memory moves,
  and it needs no `enable_sleep_mode`).
- `wake_up(tags)`: tags "weights", "kv_cache" (and vLLM's "scheduling", which has no memory); None wakes all.
  One tag at a time works: frameworks wake the weights, update them, then the KV cache.
- `is_sleeping()`: true from `sleep` until every tag is awake again.

Invariants:
- While sleeping nothing is scheduled (`sleep_halted`, part of EngineCore._set_halt); scheduling resumes only
  once every tag is awake (as vLLM: a partial wake keeps the engine asleep).
- A request added while sleeping (from `sleep` on, also while "wait" lets the others finish) is not run: it
  ends at once with finish_reason "abort", in an EngineCoreOutputs marked `sleeping=True` (the frontends refuse
  it before that: AsyncLLM with EngineSleepingError, HTTP 503; LLM.generate with a ValueError). An API server
  that had not learnt of the sleep yet (another one of `--api-server-count N` called it) turns that refusal into
  the same EngineSleepingError.
- With several API servers, every change of the sleep state a call made (asleep from `sleep` on; awake once every
  tag is) goes out as an EngineCoreOutputs with no outputs and `sleeping` set, to every server
  (vllm/v1/engine/core_proc.py), so each refuses new requests itself while the engine sleeps and accepts them
  again once it is awake, whichever server made the calls.
- Sleeping again (any level) or waking an awake tag is harmless; sleeping at 2 after 1 drops the host copy.
- `collective_rpc("sleep" | "wake_up", ...)` (verl's hybrid engine calls the worker's methods so) comes here.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from vllm.v1.engine import Deferred, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason

if TYPE_CHECKING:
    from vllm.v1.engine.core import EngineCore

SLEEP_LEVELS = (0, 1, 2)
SLEEP_TAGS = ("weights", "kv_cache")  # the worker's memory regions (vllm/v1/worker/sleep.py)
WAKE_TAGS = (*SLEEP_TAGS, "scheduling")
SLEEP_UTILITY_METHODS = frozenset({"sleep", "wake_up", "is_sleeping"})


class EngineSleepingError(RuntimeError):
    """A request sent while the engine sleeps (HTTP 503): wake it up first."""

    def __init__(self, message: str = "The engine is asleep (sleep mode): call wake_up before sending requests."
                 ) -> None:
        super().__init__(message)


def _check_sleep_args(level: object, mode: object, modes: tuple[str, ...]) -> None:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"Sleep level must be one of {SLEEP_LEVELS}, got {level!r}.")
    if mode not in modes:
        raise ValueError(f"Unknown sleep mode {mode!r}; expected one of {', '.join(modes)}.")


def check_wake_tags(tags: object) -> list[str] | None:
    if tags is None:
        return None
    if not isinstance(tags, (list, tuple)) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"tags must be a list of tag names or None, got {tags!r}.")
    unknown = sorted(set(tags) - set(WAKE_TAGS))
    if unknown:
        raise ValueError(f"Unknown wake_up tag(s) {unknown}; the tags are {', '.join(WAKE_TAGS)}.")
    return list(tags)


class EngineSleepMixin:
    """EngineCore's sleep-mode calls (module docstring)."""

    def _init_sleep(self: EngineCore) -> None:
        self.sleep_level: int | None = None
        self.sleep_halted = False

    def sleep(self: EngineCore, level: int = 1, mode: str = "abort") -> Deferred | None:
        from vllm.v1.engine.core import PAUSE_MODES
        _check_sleep_args(level, mode, PAUSE_MODES)
        if level > 0 and self.worker.sleeper is None:
            raise ValueError("Sleep mode is off: start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode) to call sleep with level 1 or 2.")
        if self.sleep_level is not None:  # asleep already: only a deeper level does anything
            if level > self.sleep_level:
                self._release_memory(level)
            return None
        self.sleep_level = level
        if mode == "abort":
            self.abort_all_requests()
        if mode == "wait":
            return Deferred(lambda: not self.batch_queue and not self.scheduler.has_unfinished_requests(),
                            lambda: self._release_memory(level))
        self._drain()
        if mode == "keep":
            self.scheduler.preempt_running()
        self._release_memory(level)
        return None

    def _release_memory(self: EngineCore, level: int) -> None:
        self.sleep_halted = True
        self._set_halt()
        self._drain()
        self.reset_prefix_cache()
        if level > 0:
            # NOTE: the KV cache comes back zeroed: no digest may outlive it, also one of a block still held (the
            # reset above leaves those).
            self.scheduler.kv_cache_manager.invalidate_prefix_cache()
            self.model_executor.run_workers("sleep", level)
        self.sleep_level = max(level, self.sleep_level or 0)

    def wake_up(self: EngineCore, tags: list[str] | None = None) -> bool:
        """Wake `tags` (None: all); returns whether the engine is fully awake (and scheduling again)."""
        tags = check_wake_tags(tags)
        if self.sleep_level is None:
            return True
        memory_tags = None if tags is None else [t for t in tags if t != "scheduling"]
        if memory_tags is None or memory_tags:
            self.model_executor.run_workers("wake_up", memory_tags)
        if not self.worker.sleeping_tags():
            self.sleep_level = None
            self.sleep_halted = False
            self._set_halt()
        return self.sleep_level is None

    def is_sleeping(self: EngineCore) -> bool:
        return self.sleep_level is not None

    def _refuse_while_sleeping(self: EngineCore, request: EngineCoreRequest) -> bool:
        """A request added while sleeping ends at once (finish_reason "abort"); True when it was refused."""
        if self.sleep_level is None:
            return False
        self.pending_outputs.append(EngineCoreOutputs(
            outputs=[EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ABORT)], sleeping=True))
        return True

    def _sleep_rpc(self: EngineCore, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        """collective_rpc("sleep" | "wake_up"): the worker methods' signatures (vLLM's), the engine's calls."""
        signature = inspect.signature(_worker_sleep if method == "sleep" else _worker_wake_up)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ValueError(f"collective_rpc: bad arguments for {method!r}: {e}") from None
        bound.apply_defaults()
        if method == "sleep":
            return self.sleep(bound.arguments["level"], "abort")
        self.wake_up(bound.arguments["tags"])
        return None


def _worker_sleep(level: int = 1) -> None: ...


def _worker_wake_up(tags: list[str] | None = None) -> None: ...
