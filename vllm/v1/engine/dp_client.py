"""DPLBAsyncMPClient: one frontend's client of several engine cores (data parallel), load-balanced.

Requests: a request with `data_parallel_rank` set (the X-data-parallel-rank header, or AsyncLLM.generate's
argument) goes to that engine core; any other goes to the least loaded one, scored as vLLM's DP load balancer
scores them: the larger of this client's requests in flight on the engine times the number of API servers, and
the engine's last reported waiting + running requests (its scheduler stats, which every API server receives),
with waiting requests counted heavier when the engine's KV cache is over half full. Ties go round-robin from an
index spread over the API servers. Aborts go to the engine that holds each request.

Utility calls (pause, resume, sleep, wake_up, reset_prefix_cache, weight updates, collective_rpc, ...) go to
every engine core at once and return when all answered: collective_rpc returns engine 0's workers' results, in
their rank order, as vLLM's DP client does (every engine ran it; `call_engine_async` reaches one engine, which is
how AsyncLLM.collective_rpc(data_parallel_rank=i) returns engine i's); reset_prefix_cache is True only when every
engine reset its cache, wake_up only when every engine is fully awake; abort_all_requests counts over all engines;
is_paused and is_sleeping are True when any engine is; any other call returns rank 0's result. When any engine
raised, the call raises the lowest rank's exception (after all answered). The ranks that join a trainer's NCCL
group (init_weight_transfer_engine, init_broadcaster) are offset per engine by `rank * tensor_parallel_size`, so
every worker of every engine has its own rank. update_weights is agreed first (weight_sync.py): every engine checks
the update on all its ranks (`check_weight_update`), and only when all accept does any engine receive it; else
every engine drops it (`discard_weight_update`, when all can) and the call raises the refusal, so no engine waits
in the trainer's broadcast for one that refused. The check and the update are separate calls and nothing
serializes weight-update calls across engines: an update that some engines applied and others refused (another
caller changed an engine in between) raises WeightsOutOfStepError ("engines out of step"), not the refusal. A dead
engine's EngineDeadError is never turned into a refusal. init_weight_transfer_engine is agreed likewise
(`check_weight_transfer_init` on every engine, with its offset, before any worker joins the trainer's rendezvous).

Invariants:
- `reqs_in_flight` holds exactly the requests this client sent and has not seen finish (a finished output, an
  abort reported by the core, or an abort sent from here), each with its engine; `engine_inflight` counts them
  per engine.
- Any engine core that dies makes the whole client dead (EngineDeadError names its rank): the frontend serves
  from all its engines or from none.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Callable
from typing import Any

import zmq

from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest, EngineStepError
from vllm.v1.engine.core_client import AsyncMPClient, EngineDeadError
from vllm.v1.engine.core_launch import EngineCoreHandle
from vllm.v1.engine.weight_sync import (JOIN, WeightDrainError, WeightsOutOfStepError, refusal_text, refused,
                                        transfer_backend, transfer_init_refused)

# The data-parallel rank the HTTP request being handled asked for (X-data-parallel-rank), for AsyncLLM.add_request
# when its caller passes none; set by the server's routes (routes.py) in the request's own task.
current_data_parallel_rank: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "current_data_parallel_rank", default=None)

# vLLM's header naming a request's engine core (header names are case-insensitive).
DATA_PARALLEL_RANK_HEADER = "X-data-parallel-rank"

# NOTE: vLLM's weighting of waiting requests on a KV-bound engine: none at up to half the KV cache in use, rising to
# 3 extra per waiting request when it is full.
_KV_WAITING_WEIGHT = 6.0
_KV_WAITING_FROM = 0.5


def check_data_parallel_rank(rank: Any, data_parallel_size: int,
                             parameter: str = "data_parallel_rank") -> int | None:
    """A request's data_parallel_rank: None, or an int in [0, data_parallel_size) (VLLMValidationError else)."""
    if rank is None:
        return None
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise VLLMValidationError(f"{parameter} must be an integer, got {rank!r}.", parameter=parameter, value=rank)
    if not 0 <= rank < data_parallel_size:
        raise VLLMValidationError(f"{parameter} {rank} is out of range [0, {data_parallel_size}).",
                                  parameter=parameter, value=rank)
    return rank


# collective_rpc methods never run on one engine alone (data_parallel_rank): sleep mode, whose state the frontend
# keeps for all its engines together (one engine asleep makes the server answer 503 for all), and the weight-update
# protocol's worker methods, which the engines agree on together (the workers refuse them by name anyway).
ENGINE_WIDE_RPC_METHODS = frozenset({
    "sleep", "wake_up", "init_weight_transfer_engine", "check_weight_transfer_init", "start_weight_update",
    "update_weights", "check_weight_update", "discard_weight_update", "finish_weight_update",
    "check_weights_from_disk", "load_weights_from_disk", "init_broadcaster", "receive_broadcast_weights"})


def check_rpc_engine(method: Any, rank: int | None) -> None:
    """VLLMValidationError when collective_rpc names one engine (`rank`) for a method of ENGINE_WIDE_RPC_METHODS."""
    if rank is not None and isinstance(method, str) and method in ENGINE_WIDE_RPC_METHODS:
        raise VLLMValidationError(
            f"collective_rpc {method!r} cannot run on one data-parallel engine (data_parallel_rank / the "
            f"{DATA_PARALLEL_RANK_HEADER} header): sleep mode and weight updates hold for every engine together. "
            "Call it without naming an engine.", parameter="data_parallel_rank", value=rank)


def parse_data_parallel_rank_header(value: str | None, data_parallel_size: int) -> int | None:
    """The X-data-parallel-rank header's rank (None when absent); VLLMValidationError for a value that is not an
    integer in range (vLLM ignores a non-integer one; here it is refused, never dropped)."""
    if value is None:
        return None
    try:
        rank = int(value.strip())
    except ValueError:
        raise VLLMValidationError(f"The {DATA_PARALLEL_RANK_HEADER} header must be an integer, got {value!r}.",
                                  parameter=DATA_PARALLEL_RANK_HEADER, value=value) from None
    return check_data_parallel_rank(rank, data_parallel_size, DATA_PARALLEL_RANK_HEADER)


def _combine(method: str, results: list[Any]) -> Any:
    """One result from every engine's (rank order), as the module docstring says."""
    if method in ("reset_prefix_cache", "wake_up"):
        return all(results)
    if method == "abort_all_requests":
        return sum(results)
    if method in ("is_paused", "is_sleeping"):
        return any(results)
    # NOTE: collective_rpc too: engine 0's workers' results, the shape vLLM's DP client returns (RL code indexes
    # them by worker rank); every engine ran the call.
    return results[0]


class DPLBAsyncMPClient(AsyncMPClient):
    def __init__(self, vllm_config: VllmConfig, engine_core_factory: Callable[[VllmConfig], Any] | None = None,
                 start_method: str = "spawn", handle: EngineCoreHandle | None = None) -> None:
        super().__init__(vllm_config, engine_core_factory, start_method, handle)
        num_engines = self.data_parallel_size
        self.tensor_parallel_size = int(vllm_config.parallel_config.tensor_parallel_size) \
            if vllm_config is not None else 1
        self.weight_transfer_backend = transfer_backend(vllm_config)
        self.client_count = self.handle.num_clients
        self.reqs_in_flight: dict[str, int] = {}
        self.engine_inflight = [0] * num_engines
        # Per engine: [waiting, running, kv_cache_usage] from its last scheduler stats (waiting raised here by
        # each request sent since).
        self.lb_engines: list[list[float]] = [[0, 0, 0.0] for _ in range(num_engines)]
        self.eng_start_index = num_engines * self.client_index // self.client_count

    # ------------------------------------------------------------------ requests

    def choose_engine(self, request: EngineCoreRequest) -> int:
        """The engine for `request` (its data_parallel_rank, or the least loaded); records it as in flight."""
        num_engines = self.data_parallel_size
        engine = request.data_parallel_rank
        if engine is not None:
            check_data_parallel_rank(engine, num_engines)
        else:
            best = float(sys.maxsize)
            engine = 0
            for i in range(num_engines):
                idx = (self.eng_start_index + i) % num_engines
                waiting, running, kv_usage = self.lb_engines[idx]
                score = max(self.client_count * self.engine_inflight[idx], waiting + running)
                if waiting:
                    score += waiting * _KV_WAITING_WEIGHT * max(0.0, kv_usage - _KV_WAITING_FROM)
                if score < best:
                    best, engine = score, idx
            self.lb_engines[engine][0] += self.client_count
            # NOTE: the next scan starts one further, so equal scores do not keep favouring one engine.
            self.eng_start_index = (self.eng_start_index + 1) % num_engines
        self.reqs_in_flight[request.request_id] = engine
        self.engine_inflight[engine] += 1
        return engine

    def engine_index_of(self, request_id: str) -> int:
        """The engine a request in flight went to (0 when unknown)."""
        return self.reqs_in_flight.get(request_id, 0)

    def _finished(self, request_id: str) -> None:
        engine = self.reqs_in_flight.pop(request_id, None)
        if engine is not None:
            self.engine_inflight[engine] -= 1

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        engine = self.choose_engine(request)
        try:
            await self.input_sockets[engine].send_multipart(self._add_frames(request), copy=False)
        except BaseException:
            self._finished(request.request_id)
            raise

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if not request_ids or self.is_dead:
            return
        by_engine: dict[int, list[str]] = {}
        for req_id in request_ids:
            engine = self.reqs_in_flight.get(req_id)
            if engine is not None:
                by_engine.setdefault(engine, []).append(req_id)
                self._finished(req_id)
        for engine, req_ids in by_engine.items():
            await self.input_sockets[engine].send_multipart(self._abort_frames(req_ids), copy=False)

    def _decode_output(self, frames: list[zmq.Frame]) -> EngineCoreOutputs | None:
        outputs = super()._decode_output(frames)
        if outputs is None:
            return None
        stats = outputs.scheduler_stats
        if stats is not None and 0 <= outputs.engine_index < len(self.lb_engines):
            self.lb_engines[outputs.engine_index] = [stats.num_waiting_reqs, stats.num_running_reqs,
                                                     stats.kv_cache_usage]
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self._finished(output.request_id)
        for req_id in outputs.finished_requests or ():
            self._finished(req_id)
        return outputs

    # ------------------------------------------------------------------ utility calls

    async def call_utility_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The call on every engine core; one combined result (module docstring)."""
        if method == "update_weights":
            await self._agree_on_update(*args, **kwargs)
            return await self._update_every_engine(args, kwargs)
        if method == "init_weight_transfer_engine":
            await self._agree_on_transfer_init(args, kwargs)
        return _combine(method, await self._on_every_engine(method, args, kwargs))

    async def _outcomes(self, method: str, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        """Every engine's result or exception, in rank order, once all answered."""
        calls = [self.call_engine_async(e, method, *self._engine_args(method, args, kwargs, e))
                 for e in range(self.data_parallel_size)]
        return await asyncio.gather(*calls, return_exceptions=True)

    async def _on_every_engine(self, method: str, args: tuple, kwargs: dict[str, Any]) -> list[Any]:
        results = await self._outcomes(method, args, kwargs)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    async def _update_every_engine(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """update_weights on every engine (after the agreement). Some engines applied it and others did not (an
        engine changed by another caller between the check and the update: the calls are not serialized across
        engines) -> WeightsOutOfStepError; every engine failed -> the lowest rank's error; a dead engine's
        EngineDeadError first."""
        results = await self._outcomes("update_weights", args, kwargs)
        errors = [(e, r) for e, r in enumerate(results) if isinstance(r, BaseException)]
        if not errors:
            return None
        for _, error in errors:
            if isinstance(error, (EngineDeadError, EngineStepError)):
                raise error
        if len(errors) == len(results):
            raise errors[0][1]
        applied = ", ".join(str(e) for e, r in enumerate(results) if not isinstance(r, BaseException))
        failed = "; ".join(f"engine {e}: {type(r).__name__}: {r}" for e, r in errors)
        raise WeightsOutOfStepError(
            f"Data-parallel engines out of step: the weight update was applied by engine(s) {applied} but not by "
            f"{len(errors)} of {len(results)} engines ({failed}), so the engines now serve different weights. "
            "Weight-update calls from several callers are not serialized across engines. Restart the server, or "
            "send a complete update of every weight to every engine again (finish_weight_update, "
            "start_weight_update, update_weights).") from errors[0][1]

    async def _agree_on_transfer_init(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Return when every engine's workers would join the trainer's group (each with its rank offset); else
        raise the refusal before any worker joins (weight_sync.py)."""
        verdicts = await self._on_every_engine("check_weight_transfer_init", args, kwargs)
        problems = [(e, problem) for e, problem in enumerate(verdicts) if problem is not None]
        if problems:
            text = refusal_text(problems, self.data_parallel_size, "data-parallel engine", JOIN)
            raise transfer_init_refused(text)

    async def _agree_on_update(self, update_info: Any) -> None:
        """Return when every engine accepts `update_info`; else have every engine drop the trainer's broadcast
        (when all can receive it) and raise the refusal (weight_sync.py)."""
        verdicts = await self._on_every_engine("check_weight_update", (update_info,), {})
        problems = [(e, problem) for e, (problem, _) in enumerate(verdicts) if problem is not None]
        if not problems:
            return
        drained: bool | WeightDrainError = False
        if all(receivable for _, receivable in verdicts):
            try:
                await self._drop_on_every_engine(update_info)
                drained = True
            except WeightDrainError as e:
                drained = e
        raise refused(refusal_text(problems, self.data_parallel_size, "data-parallel engine"),
                      self.weight_transfer_backend, drained)

    async def _drop_on_every_engine(self, update_info: Any) -> None:
        """Every engine receives the refused update and drops it; WeightDrainError naming the engines where that
        failed; any other error (EngineDeadError, ...) as it is, the lowest rank's."""
        results = await self._outcomes("discard_weight_update", (update_info,), {})
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, WeightDrainError):
                raise result
        failed = [(e, r) for e, r in enumerate(results) if isinstance(r, WeightDrainError)]
        if failed:
            raise WeightDrainError("; ".join(f"engine {e}: {r}" for e, r in failed)) from failed[0][1]

    def _engine_args(self, method: str, args: tuple, kwargs: dict[str, Any],
                     engine: int) -> tuple[tuple, dict[str, Any]]:
        """`args` and `kwargs` for `engine`: its workers' ranks in a trainer's NCCL group come after the lower
        ranks' workers, whether the rank offset came positionally or by keyword."""
        offset = engine * self.tensor_parallel_size
        where = _RANK_OFFSET_ARGUMENT.get(method)
        if not offset or where is None:
            return args, kwargs
        name, position = where
        args, kwargs = list(args), dict(kwargs)
        if name in kwargs:
            kwargs[name] = _add_rank_offset(method, kwargs[name], offset)
        elif len(args) > position:
            args[position] = _add_rank_offset(method, args[position], offset)
        return tuple(args), kwargs


# The parameter that carries a trainer NCCL group's rank offset: (its name, its position) in the engine core's
# method (core.py); init_weight_transfer_engine's is the init_info dict, whose "rank_offset" key is offset.
_RANK_OFFSET_ARGUMENT = {"init_weight_transfer_engine": ("init_info", 0),
                         "check_weight_transfer_init": ("init_info", 0), "init_broadcaster": ("rank_offset", 2)}


def _add_rank_offset(method: str, value: Any, offset: int) -> Any:
    if method in ("init_weight_transfer_engine", "check_weight_transfer_init"):
        if isinstance(value, dict) and "rank_offset" in value:
            return {**value, "rank_offset": int(value["rank_offset"]) + offset}
        return value
    return int(value) + offset
