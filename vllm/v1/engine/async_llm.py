"""AsyncLLM: the asyncio frontend of the server: input processing here, the engine core in a child process.

`generate()` validates and tokenizes (ValueError before anything reaches the core), registers a per-request
queue with the OutputProcessor, sends the request, and yields RequestOutputs from the queue. One output-handler
task reads EngineCoreOutputs from the client, runs the OutputProcessor (which feeds the queues), aborts in the
core the requests a stop string ended here, and records metrics.

Invariants:
- An output stream (OutputStream) that is cancelled or closed early (client disconnect) aborts its request in
  the core at once, so its KV blocks are freed; for n > 1 that is every child (one queue per user request,
  shared by its children). Nothing waits for the garbage collector.
- Once the core process dies, every waiting request gets `EngineDeadError` and new requests are refused;
  `errored` / `dead_error` tell the server.
- With data parallel (`data_parallel_size` N) the client is a DPLBAsyncMPClient over N engine cores
  (vllm/v1/engine/dp_client.py): each request goes to one engine (`data_parallel_rank`, else the least loaded),
  every call below (pause, weight updates, collective_rpc, sleep, ...) to all of them; the metrics carry
  `engine="i"`. Any engine that dies makes the whole frontend dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any, Protocol

from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.inputs import PromptType
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.utils import refuse_stat_loggers, unwrap_info
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.core_client import EngineCoreHandle, EngineDeadError, make_async_client
from vllm.v1.engine.dp_client import check_data_parallel_rank, check_rpc_engine, current_data_parallel_rank
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.engine.output_collector import RequestOutputCollector
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.sleep_mode import EngineSleepingError
from vllm.v1.metrics.loggers import PrometheusStatLogger
from vllm.v1.metrics.stats import RequestStatsTracker

logger = logging.getLogger(__name__)
# NOTE: most queued engine steps processed in one go before the event loop serves the streams again.
_MAX_STEPS_PER_WAKE = 64
# NOTE: child requests of an n > 1 request sent between two turns of the event loop.
_CHILDREN_PER_YIELD = 256


class _Aborter(Protocol):
    def _abort_now(self, request_ids: list[str]) -> None: ...


class OutputStream:
    """One request's outputs, as an async iterator that ends after the finished one (or raises the request's
    error). `close()` before that aborts the request in the core, whether or not iteration began; a task waiting
    for the next output then ends its iteration. A cancellation while waiting for an output aborts it too. One task
    reads it at a time: a second one asking while the first waits gets a RuntimeError (and aborts nothing).

    Why not an async generator: a generator closed before its first step runs no cleanup, and one left suspended
    by a cancelled consumer is only finalised when the garbage collector gets to it (a reference cycle through
    the cancelled frames can keep it for as long as no full collection runs): its request would go on generating
    for a client that has gone. The server closes its streams explicitly when a response ends; a stream dropped
    unclosed and unfinished (a caller's `break`) still aborts when it is freed, as a generator would."""

    __slots__ = ("_engine", "request_id", "_queue", "_done", "_loop")

    def __init__(self, engine: _Aborter, request_id: str, queue: RequestOutputCollector) -> None:
        self._engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False  # finished, failed or closed: nothing more to yield, nothing to abort
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        queue = self._queue
        # NOTE: RequestOutputCollector.get inlined (one coroutine less to create and resume per output).
        while queue.empty() and not queue.closed:
            # NOTE: outside the try: a second task reading this stream while one waits is refused (RuntimeError)
            # without aborting the request the first one reads.
            waiter = queue.wait()
            try:
                await waiter
            except BaseException:  # cancelled while waiting: the consumer is gone
                self.close()
                raise
        # None: closed by another task while this one waited.
        item = None if self._done or queue.empty() else queue.get_nowait()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            queue.close()
            raise item
        if item.finished:
            self._done = True
            queue.close()
        return item

    def close(self) -> None:
        """Stop: abort the request if it has not finished, and drop what was not taken. Idempotent; never raises
        (it runs in `finally` blocks, under a cancellation it must not replace)."""
        if not self._done:
            self._done = True
            try:
                self._engine._abort_now([self.request_id])
            except Exception:
                logger.exception("Aborting request %s failed.", self.request_id)
            # NOTE: after the abort, which may leave an output for the request here.
            self._queue.close()

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        # NOTE: a safety net for callers that drop a stream without closing it; runs in the loop, where
        # _abort_now may create its task.
        if not self._done and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.close)


class AsyncLLM:
    def __init__(self, vllm_config: VllmConfig, log_stats: bool = True,
                 core_handle: EngineCoreHandle | None = None, log_requests: bool = False) -> None:
        """core_handle: join an engine core shared by several API servers (launch_engine_core) instead of
        starting one. log_stats: record the Prometheus metrics. log_requests: log each added request at INFO."""
        self.vllm_config = vllm_config
        mc = vllm_config.model_config
        self.model_config = mc
        self.tokenizer: Tokenizer | None = None if mc.skip_tokenizer_init else get_tokenizer(str(mc.tokenizer))
        self.input_processor = InputProcessor(vllm_config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, log_stats=False)
        self.engine_core = make_async_client(vllm_config, core_handle)
        self.num_gpu_blocks = int(self.engine_core.ready_info.get("num_gpu_blocks", 0))
        self.log_stats = log_stats
        self.log_requests = log_requests
        self.stat_logger = PrometheusStatLogger(
            mc.name, [int(info.get("num_gpu_blocks", 0)) for info in self.engine_core.engines_ready_info])
        self.request_stats = RequestStatsTracker()
        self.output_handler: asyncio.Task | None = None
        self._background_tasks: set[asyncio.Task] = set()
        # What this frontend last learnt of sleep mode (its own sleep / wake_up / is_sleeping calls, and the
        # engine core's news of its state, EngineCoreOutputs.sleeping, also of another API server's calls): new
        # requests are refused while true, and so is one the core refused because it sleeps.
        self.sleeping = False
        # NOTE: as vLLM's: made inside an event loop (the API server), the output loop starts now, so this frontend
        # hears the core's news (sleep mode) before its first request; elsewhere with the first request or call.
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._ensure_output_handler()

    @classmethod
    def from_vllm_config(cls, vllm_config: VllmConfig, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None, enable_log_requests: bool = False,
                         disable_log_stats: bool = False) -> AsyncLLM:
        """vLLM's constructor. start_engine_loop and usage_context have no effect: the output loop starts with the
        first request either way, and no usage stats are collected."""
        refuse_stat_loggers(stat_loggers)
        return cls(vllm_config, log_stats=not disable_log_stats, log_requests=enable_log_requests)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Any = None, enable_log_requests: bool = False,
                         disable_log_stats: bool = False) -> AsyncLLM:
        """From EngineArgs or AsyncEngineArgs; request logging and stats follow the arguments or engine_args (on
        when either asks)."""
        return cls.from_vllm_config(
            engine_args.create_engine_config(), start_engine_loop, usage_context, stat_loggers,
            enable_log_requests=enable_log_requests or getattr(engine_args, "enable_log_requests", False),
            disable_log_stats=disable_log_stats or engine_args.disable_log_stats)

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self.engine_core.dead_error if self.engine_core.is_dead else None

    @property
    def errored(self) -> bool:
        return self.engine_core.is_dead

    def get_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("The tokenizer was not initialized (skip_tokenizer_init=True).")
        return self.tokenizer

    async def check_health(self) -> None:
        error = self.dead_error
        if error is not None:
            raise error

    def _ensure_output_handler(self) -> None:
        if self.output_handler is None or self.output_handler.done():
            self.output_handler = asyncio.get_running_loop().create_task(self._run_output_handler())

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                          lora_request: Any = None, priority: int = 0,
                          data_parallel_rank: int | None = None) -> RequestOutputCollector:
        """Validate, register and send one request; raises ValueError (bad input, a lora_request, a priority
        other than 0, a data_parallel_rank out of range) or EngineDeadError. data_parallel_rank (vLLM's): the
        engine core that serves it (all its n > 1 children); None: the X-data-parallel-rank header of the HTTP
        request being handled, if any, else the least loaded engine."""
        if data_parallel_rank is None:
            data_parallel_rank = current_data_parallel_rank.get()
        data_parallel_rank = check_data_parallel_rank(data_parallel_rank, self.engine_core.data_parallel_size)
        await self.check_health()
        if self.sleeping:
            raise EngineSleepingError()
        request, prompt_text = self.input_processor.process_inputs(request_id, prompt, params, time.time(),
                                                                   lora_request=lora_request, priority=priority)
        if self.log_requests:
            logger.info("Added request %s: %d prompt tokens, %r.", request_id, len(request.prompt_token_ids),
                        params)
        queue = RequestOutputCollector(params.output_kind)
        core_requests = self.output_processor.add_request(request, prompt_text, queue)
        self._ensure_output_handler()
        try:
            for i, core_request in enumerate(core_requests, 1):
                core_request.data_parallel_rank = data_parallel_rank
                if self.log_stats:
                    self.request_stats.add_request(core_request.request_id, len(request.prompt_token_ids))
                await self.engine_core.add_request_async(core_request)
                if i % _CHILDREN_PER_YIELD == 0:
                    # NOTE: a send that completes at once does not yield: a large n would hold the event loop
                    # (every other stream, /health) for the whole fan-out; the children are made as they are
                    # sent (OutputProcessor.add_request), so each slice of the fan-out is short.
                    await asyncio.sleep(0)
        except BaseException:
            # NOTE: with n > 1 some children may already be in the core; aborting unknown ids there is a no-op.
            self._abort_now([request_id])
            raise
        return queue

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str, *,
                       lora_request: Any = None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as they come. lora_request and priority are vLLM's; anything but their defaults
        raises ValueError (no LoRA, no priority scheduling). data_parallel_rank: as add_request."""
        queue = await self.add_request(request_id, prompt, sampling_params, lora_request=lora_request,
                                       priority=priority, data_parallel_rank=data_parallel_rank)
        stream = self.stream_outputs(request_id, queue)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def stream_outputs(self, request_id: str, queue: RequestOutputCollector) -> OutputStream:
        """A request's outputs until it finishes (an async iterator); closing or cancelling it early aborts the
        request.

        Streamed (DELTA) outputs that arrive faster than the caller takes them come merged (one output for
        several engine steps), see RequestOutputCollector."""
        return OutputStream(self, request_id, queue)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's call to drop cached KV blocks (trainers call it after a weight update; finish_weight_update
        already invalidates them here): False while requests hold blocks, unless reset_running_requests, which
        preempts every running request first (each recomputes its KV later). There is no KV connector."""
        return await self._call("reset_prefix_cache", reset_running_requests, reset_connector)

    async def is_sleeping(self) -> bool:
        """Whether the engine core sleeps (at any level, partly woken included)."""
        self.sleeping = await self._call("is_sleeping")
        return self.sleeping

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Sleep mode (vllm/v1/engine/sleep_mode.py; needs enable_sleep_mode for levels 1 and 2): the requests
        in the engine are handled by `mode` as a pause's; new ones raise EngineSleepingError (HTTP 503) here
        until `wake_up` has woken every tag."""
        self.sleeping = True
        try:
            await self._call("sleep", level, mode)
        except BaseException:
            self.sleeping = await self._call("is_sleeping")
            raise

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Memory back for tags ("weights", "kv_cache", "scheduling"; None: all), one at a time if wanted."""
        self.sleeping = not await self._call("wake_up", tags)

    # ------------------------------------------------------------------ the RL lifecycle (docs/rl.md)

    async def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        await self.check_health()
        self._ensure_output_handler()  # NOTE: it reads the results off the output socket
        return await self.engine_core.call_utility_async(method, *args, **kwargs)

    async def _call_engine(self, engine: int, method: str, *args: Any) -> Any:
        """`_call` to one engine core (its data-parallel rank) only."""
        await self.check_health()
        self._ensure_output_handler()
        return await self.engine_core.call_engine_async(engine, method, args, {})

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True,
                               wait_for_inflight_requests: bool | None = None) -> None:
        """Pause generation in the engine core (for every API server of it); returns once paused:
        - "abort": every running and waiting request ends now, finish_reason "abort", with its partial output;
        - "wait": the requests already in the engine run to completion first;
        - "keep": nothing is scheduled; the requests keep their places and go on after resume.
        Requests added while paused wait in the engine and run after `resume_generation()`. clear_cache (vLLM's
        default True): once paused, reset the prefix cache; in keep mode this preempts the kept requests, which
        recompute their KV after resume (pass False to keep it). wait_for_inflight_requests (vLLM's older
        argument): True is mode "wait"."""
        if wait_for_inflight_requests:
            mode = "wait"
        await self._call("pause_generation", mode, clear_cache)

    async def resume_generation(self) -> None:
        """Resume after a pause (ValueError when not paused)."""
        await self._call("resume_generation")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    async def collective_rpc(self, method: str | Callable[..., Any], timeout: float | None = None, args: tuple = (),
                             kwargs: dict[str, Any] | None = None, *,
                             data_parallel_rank: int | None = None) -> list[Any]:
        """Run a worker method (by name, or a picklable callable taking the worker first) on every worker, after
        the steps in flight; one result per worker. TimeoutError after `timeout` seconds (the call itself runs
        on). With data parallel every engine core runs it and the results are engine 0's workers' (vLLM's);
        data_parallel_rank=i (not vLLM's) runs it on engine core i alone and returns its workers' results, except
        for sleep, wake_up and the weight-update methods (VLLMValidationError: they hold for every engine)."""
        rank = check_data_parallel_rank(data_parallel_rank, self.engine_core.data_parallel_size)
        check_rpc_engine(method, rank)
        call = self._call("collective_rpc", method, timeout, tuple(args), kwargs) if rank is None else \
            self._call_engine(rank, "collective_rpc", method, timeout, tuple(args), kwargs)
        results = await (asyncio.wait_for(call, timeout) if timeout is not None else call)
        if method in ("sleep", "wake_up"):  # the engine's sleep mode (verl's hybrid engine calls it so)
            self.sleeping = await self._call("is_sleeping")
        return results

    async def init_weight_transfer_engine(self, init_info: Any) -> None:
        """Join the trainer's weight-transfer group ({"master_address", "master_port", "rank_offset",
        "world_size"} for nccl; {} for ipc and disk); also takes {"init_info": {...}}."""
        await self._call("init_weight_transfer_engine", unwrap_info(init_info, "init_info"))

    async def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        """Begin an update: generation stops (the steps in flight finish first) until finish_weight_update."""
        await self._call("start_weight_update", is_checkpoint_format)

    async def update_weights(self, update_info: Any) -> None:
        """Receive weights and copy them into the model (checked whole first: a refused update changes nothing)."""
        await self._call("update_weights", unwrap_info(update_info, "update_info"))

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        """End the update; later tokens carry `weight_version` (when given) in their outputs."""
        await self._call("finish_weight_update", weight_version)

    async def get_weight_version(self) -> str | None:
        return await self._call("get_weight_version")

    async def update_weight_version(self, new_version: str | None) -> None:
        await self._call("update_weight_version", new_version)

    async def weight_info(self) -> dict[str, Any]:
        return await self._call("weight_info")

    async def init_broadcaster(self, host: str, port: int, rank_offset: int, inference_world_size: int,
                               timeout: float) -> None:
        """Join prime-rl's NCCL weight broadcast (its /init_broadcaster)."""
        await self._call("init_broadcaster", host, port, rank_offset, inference_world_size, timeout)

    async def load_weights_from_broadcast(self, weight_version: str | None = None) -> None:
        """A whole update received from prime-rl's broadcaster (its /update_weights {"weight_dir": null})."""
        await self._call("load_weights_from_broadcast", weight_version)

    async def load_weights_from_disk(self, path: str, weight_version: str | None = None) -> None:
        """A whole update from a folder of safetensors (prime-rl's /update_weights {"weight_dir"}), whatever the
        configured backend, in one engine-core call (EngineCore.load_weights_from_disk)."""
        await self._call("load_weights_from_disk", path, weight_version)

    async def abort(self, request_id: str | list[str]) -> None:
        self._abort_now([request_id] if isinstance(request_id, str) else list(request_id))

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort these requests of this frontend, or (none given) every request of the engine core, whichever
        frontend sent it; each ends with finish_reason "abort" and its partial output. Returns how many."""
        if request_ids:
            return len(self._abort_now(list(request_ids)))
        return await self._call("abort_all_requests")

    def _abort_now(self, request_ids: list[str]) -> list[str]:
        """Forget the requests here and send ABORT to the core without waiting (safe inside `finally`); returns
        the engine-core ids that were running."""
        aborted = self.output_processor.abort_requests(request_ids)
        if self.log_stats:
            for req_id in aborted:
                self.stat_logger.record_finished(self.request_stats.abort([req_id]),
                                                 self.engine_core.engine_index_of(req_id))
        if aborted and not self.engine_core.is_dead:
            task = asyncio.get_running_loop().create_task(self.engine_core.abort_requests_async(aborted))
            self._background_tasks.add(task)
            task.add_done_callback(self._background_tasks.discard)
        return aborted

    async def _run_output_handler(self) -> None:
        try:
            while True:
                outputs = await self.engine_core.get_output_async()
                # NOTE: every step already queued is processed before the streams run again. When the HTTP side
                # lags behind the engine, the streams then find several steps merged in their collectors and
                # send one chunk for all of them, instead of one chunk per step falling further behind.
                for _ in range(_MAX_STEPS_PER_WAKE):
                    await self._process_engine_outputs(outputs)
                    outputs = self.engine_core.get_output_nowait()
                    if outputs is None:
                        break
                else:
                    await self._process_engine_outputs(outputs)
        except EngineDeadError as e:
            logger.error("The engine core died: %s", e)
            self._fail_all(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.exception("The output handler failed.")
            self._fail_all(EngineDeadError(f"The output handler failed: {e!r}"))
            self.engine_core.dead_error = EngineDeadError(f"The output handler failed: {e!r}")

    async def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.sleeping is not None:
            self.sleeping = outputs.sleeping
            if outputs.sleeping and outputs.outputs:
                await self.engine_core.abort_requests_async(self._fail_refused(outputs.outputs))
        processed = self.output_processor.process_outputs(outputs.outputs, outputs.weight_version)
        if processed.reqs_to_abort:
            await self.engine_core.abort_requests_async(processed.reqs_to_abort)
        if self.log_stats:
            engine = outputs.engine_index
            self.stat_logger.record_iteration(self.request_stats.update(outputs.outputs, processed.reqs_to_abort),
                                              engine)
            if outputs.scheduler_stats is not None:
                self.stat_logger.record_scheduler_stats(outputs.scheduler_stats, engine)

    def _fail_refused(self, refused: list[EngineCoreOutput]) -> list[str]:
        """Requests the engine core refused because it sleeps (another API server put it to sleep before this one
        learnt of it): each fails with EngineSleepingError, as this server's own refusal does (HTTP 503), and is
        forgotten; returns the ids of their n > 1 siblings still in the core, to abort there."""
        states, parents = self.output_processor.request_states, self.output_processor.parent_requests
        error = EngineSleepingError()
        siblings: list[str] = []
        for output in refused:
            state = states.pop(output.request_id, None)
            if state is None:
                continue
            if state.parent is not None and parents.pop(state.parent.request_id, None) is not None:
                for child_id in state.parent.child_request_ids:
                    if states.pop(child_id, None) is not None:
                        siblings.append(child_id)
            if state.queue is not None:
                state.queue.put_nowait(error)
        return siblings

    def _fail_all(self, error: BaseException) -> None:
        self.engine_core.fail_calls(error)
        queues = {id(s.queue): s.queue for s in self.output_processor.request_states.values() if s.queue is not None}
        for queue in queues.values():
            queue.put_nowait(error)
        self.output_processor.request_states.clear()
        self.output_processor.parent_requests.clear()

    def shutdown(self) -> None:
        if self.output_handler is not None and not self.output_handler.done():
            self.output_handler.cancel()
        self.engine_core.fail_calls(EngineDeadError("The engine was shut down."))
        self.engine_core.shutdown()
