"""The server's admin endpoints for RL training loops (docs/rl.md), with vLLM's paths and bodies.

Mounted only with VLLM_SERVER_DEV_MODE=1 or `--enable-rl-endpoints` (vLLM's gating): they pause generation, load
weights from any folder the server can read, and run worker methods by name, so they are for a trusted network
(the --api-key covers /v1 and /inference only). Every call goes to every engine core (each data-parallel rank),
whichever API server (--api-server-count) receives it.

- Pause: POST /pause?mode=abort|wait|keep&clear_cache= -> {"status": "paused"}; POST /resume -> {"status":
  "resumed"} (400 when not paused); GET /is_paused; POST /abort_requests {"request_ids": [...]} (none or empty:
  every request of the engine) -> {"status": "aborted", "aborted": n}; POST /reset_prefix_cache (query
  parameters, or SkyRL's JSON body) -> 200, empty; 409 while requests hold KV blocks (vLLM's).
- Weight updates (vLLM's four steps): POST /init_weight_transfer_engine {"init_info"}, /start_weight_update
  {"is_checkpoint_format"?}, /update_weights {"update_info"}, /finish_weight_update {"weight_version"?} ->
  {"message": ...}; GET /get_world_size, GET /weight_info, POST /update_weight_version {"new_version"}.
- prime-rl's dialect on the same paths: POST /init_broadcaster {"host", "port", "rank_offset",
  "inference_world_size", "timeout"} (join its NCCL broadcaster) -> {"status": "ok"}; POST /update_weights
  {"weight_dir": dir} (a whole update from that folder) or {"weight_dir": null} (from the broadcaster) ->
  {"status": "ok"}; GET /liveness (503 once the engine core died).
- POST /collective_rpc {"method", "args", "kwargs", "timeout"} -> {"results": [one per worker]} (504 after
  timeout); with data parallel every engine runs it and the results are engine 0's workers' (vLLM's), or, with
  an X-data-parallel-rank header (not vLLM's), engine i alone runs it and answers with its workers' results.
- Sleep mode (vLLM's, with --enable-sleep-mode): POST /sleep?level=1|2&mode=abort|wait|keep and POST
  /wake_up?tags=weights&tags=kv_cache (repeated query parameter; none: all) -> 200, empty body, as vLLM; GET
  /is_sleeping -> {"is_sleeping": bool}. While asleep, generation requests get 503 (http_errors.py).
Bad input is a 400 with an OpenAI error body; a refused weight update changes no weight.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vllm.entrypoints.openai.serving_engine import error_body
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.dp_client import DATA_PARALLEL_RANK_HEADER, parse_data_parallel_rank_header


async def _body(raw: Request) -> dict[str, Any]:
    """The JSON object body, {} when empty (SkyRL sends `{}` with GETs, prime-rl nothing with /resume)."""
    data = await raw.body()
    if not data.strip():
        return {}
    try:
        body = json.loads(data)
    except ValueError as e:
        raise ValueError(f"The request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError(f"The request body must be a JSON object, got {type(body).__name__}.")
    return body


def _flag(raw: Request, name: str, default: bool) -> bool:
    value = raw.query_params.get(name)
    if value is None:
        return default
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"Query parameter {name}={value!r} is not a boolean (true or false).")


def _required(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise ValueError(f"Missing {key!r} in the request body.")
    return body[key]


def _jsonable(value: Any) -> Any:
    """A collective_rpc result as vLLM returns it: None, dicts and lists as they are, anything else as text."""
    if value is None or isinstance(value, (dict, list, str, int, float, bool)):
        try:
            json.dumps(value)
            return value
        except (TypeError, ValueError):
            pass
    return str(value)


def attach_admin_router(app: FastAPI, engine: AsyncLLM) -> None:
    router = APIRouter()

    @router.post("/pause")
    async def pause(raw: Request) -> JSONResponse:
        mode = raw.query_params.get("mode", "abort")
        if _flag(raw, "wait_for_inflight_requests", False):
            mode = "wait"
        await engine.pause_generation(mode=mode, clear_cache=_flag(raw, "clear_cache", True))
        return JSONResponse({"status": "paused"})

    @router.post("/resume")
    async def resume() -> JSONResponse:
        await engine.resume_generation()
        return JSONResponse({"status": "resumed"})

    @router.get("/is_paused")
    async def is_paused() -> JSONResponse:
        return JSONResponse({"is_paused": await engine.is_paused()})

    @router.post("/abort_requests")
    async def abort_requests(raw: Request) -> JSONResponse:
        request_ids = (await _body(raw)).get("request_ids") or []
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise ValueError("request_ids must be a list of request id strings.")
        aborted = await engine.abort_requests(request_ids)
        return JSONResponse({"status": "aborted", "aborted": aborted})

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(raw: Request) -> Response:
        body = await _body(raw)
        running = _flag(raw, "reset_running_requests", bool(body.get("reset_running_requests", False)))
        if not await engine.reset_prefix_cache(running, _flag(raw, "reset_external", False)):
            # NOTE: vLLM's answer when requests hold blocks (and reset_running_requests is false).
            return JSONResponse(error_body("Prefix cache reset failed: requests hold KV blocks (pass "
                                           "reset_running_requests=true to preempt them).", 409, "Conflict"),
                                status_code=409)
        return Response(status_code=200)

    @router.post("/collective_rpc")
    async def collective_rpc(raw: Request) -> Response:
        body = await _body(raw)
        method = _required(body, "method")
        args, kwargs, timeout = body.get("args") or [], body.get("kwargs") or {}, body.get("timeout")
        if not isinstance(method, str) or not method:
            raise ValueError("method must be the name of a worker method.")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise ValueError("args must be a list and kwargs an object.")
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or not timeout > 0):
            raise ValueError(f"timeout must be a positive number of seconds or null, got {timeout!r}.")
        rank = parse_data_parallel_rank_header(raw.headers.get(DATA_PARALLEL_RANK_HEADER),
                                               engine.engine_core.data_parallel_size)
        try:
            results = await engine.collective_rpc(method, timeout=timeout, args=tuple(args), kwargs=kwargs,
                                                  data_parallel_rank=rank)
        except (TimeoutError, asyncio.TimeoutError):
            return _timeout(f"collective_rpc {method!r} did not finish within {timeout} s.")
        return JSONResponse({"results": [_jsonable(r) for r in results]})

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(raw: Request) -> JSONResponse:
        await engine.init_weight_transfer_engine(_required(await _body(raw), "init_info"))
        return JSONResponse({"message": "Weight transfer initialized"})

    @router.post("/start_weight_update")
    async def start_weight_update(raw: Request) -> JSONResponse:
        await engine.start_weight_update((await _body(raw)).get("is_checkpoint_format", True))
        return JSONResponse({"message": "Weight update started"})

    @router.post("/update_weights")
    async def update_weights(raw: Request) -> JSONResponse:
        body = await _body(raw)
        if "update_info" in body:
            await engine.update_weights(body["update_info"])
            return JSONResponse({"message": "Weights updated"})
        if "weight_dir" in body:  # prime-rl's dialect: a whole update from a folder, or from its broadcaster
            weight_dir = body["weight_dir"]
            if weight_dir is None:
                await engine.load_weights_from_broadcast(body.get("weight_version"))
            elif isinstance(weight_dir, str) and weight_dir:
                await engine.load_weights_from_disk(weight_dir, body.get("weight_version"))
            else:
                raise ValueError("weight_dir must be the path of a folder of safetensors, or null to receive "
                                 "the weights from the broadcaster of /init_broadcaster.")
            return JSONResponse({"status": "ok"})
        raise ValueError("Missing 'update_info' in the request body (or prime-rl's 'weight_dir').")

    @router.post("/finish_weight_update")
    async def finish_weight_update(raw: Request) -> JSONResponse:
        await engine.finish_weight_update((await _body(raw)).get("weight_version"))
        return JSONResponse({"message": "Weight update finished"})

    @router.post("/update_weight_version")
    async def update_weight_version(raw: Request) -> JSONResponse:
        new_version = _required(await _body(raw), "new_version")
        await engine.update_weight_version(new_version)
        return JSONResponse({"success": True, "new_version": new_version})

    @router.get("/weight_info")
    async def weight_info() -> JSONResponse:
        return JSONResponse({"weight_version": await engine.get_weight_version()})

    @router.get("/get_world_size")
    async def get_world_size(raw: Request) -> JSONResponse:
        # NOTE: vLLM's: the workers of one engine core, times the data-parallel engines with include_dp.
        parallel = engine.vllm_config.parallel_config
        num_engines = parallel.data_parallel_size if _flag(raw, "include_dp", True) else 1
        return JSONResponse({"world_size": parallel.tensor_parallel_size * num_engines})

    @router.post("/init_broadcaster")
    async def init_broadcaster(raw: Request) -> JSONResponse:
        body = await _body(raw)
        unknown = sorted(set(body) - _BROADCASTER_KEYS)
        if unknown:
            raise ValueError(f"Unknown /init_broadcaster key(s) {unknown}; the known ones are "
                             f"{sorted(_BROADCASTER_KEYS)}.")
        if body.get("quantize_in_weight_transfer"):
            raise ValueError("quantize_in_weight_transfer is not supported: the broadcast must carry "
                             "checkpoint-format weights.")
        parallel = engine.vllm_config.parallel_config
        num_workers = parallel.tensor_parallel_size * parallel.data_parallel_size
        if body.get("engine_world_size") not in (None, num_workers):
            raise ValueError(f"engine_world_size={body['engine_world_size']!r}: this server has {num_workers} "
                             "worker(s).")
        await engine.init_broadcaster(_required(body, "host"), _required(body, "port"),
                                      body.get("rank_offset", 0), _required(body, "inference_world_size"),
                                      body.get("timeout", 1200))
        return JSONResponse({"status": "ok"})

    @router.get("/liveness")
    async def liveness() -> JSONResponse:
        # NOTE: the engine core's process, not a round trip to it: a weight transfer keeps the core busy for as
        # long as it takes, and a liveness probe must not restart a server for that.
        if engine.errored:
            return JSONResponse({"status": "engine_unresponsive"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @router.post("/sleep")
    async def sleep(raw: Request) -> Response:
        level = raw.query_params.get("level", "1")
        try:
            level_int = int(level)
        except ValueError:
            raise ValueError(f"Query parameter level={level!r} is not an integer (0, 1 or 2).") from None
        await engine.sleep(level_int, raw.query_params.get("mode", "abort"))
        return Response(status_code=200)

    @router.post("/wake_up")
    async def wake_up(raw: Request) -> Response:
        await engine.wake_up(raw.query_params.getlist("tags") or None)
        return Response(status_code=200)

    @router.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        return JSONResponse({"is_sleeping": await engine.is_sleeping()})

    app.include_router(router)


# prime-rl's /init_broadcaster body, over its versions (session_id and gpus_per_server have no effect here).
_BROADCASTER_KEYS = frozenset({"host", "port", "rank_offset", "inference_world_size", "timeout",
                               "quantize_in_weight_transfer", "engine_world_size", "session_id", "gpus_per_server"})


def _timeout(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, 504, "TimeoutError"), status_code=504)
