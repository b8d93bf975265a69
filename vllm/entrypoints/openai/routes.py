"""The server's OpenAI and vLLM routes: GET /health, /version, /metrics, /v1/models; POST /v1/completions,
/v1/chat/completions, /inference/v1/generate, /tokenize, /detokenize. (The RL admin routes are admin.py's.)

Invariants:
- The routes only parse and dispatch: the serving objects on `app.state` (build_app, app.py) do the work, and a
  generation route's handler runs under `cancel_on_disconnect` and the server's drain (http_responses.py).
- A generation route's X-data-parallel-rank header (vLLM's) picks the engine of the requests it adds; a bad value
  is a 400 before any work.
- /health is 200 while the engine lives, 503 with the reason in an OpenAI body once it died (as vLLM's).
- /tokenize picks its request model by the body's form (`messages` or `prompt`), so the other form never reports
  the first one's fields as unknown.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

import vllm
from vllm.entrypoints.openai.http_errors import error_response
from vllm.entrypoints.openai.http_responses import cancel_on_disconnect, respond
from vllm.entrypoints.openai.openapi import route_responses
from vllm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatCompletionResponse
from vllm.entrypoints.openai.protocol_completion import CompletionRequest, CompletionResponse
from vllm.entrypoints.openai.protocol_generate import GenerateRequest, GenerateResponse
from vllm.entrypoints.openai.protocol_tokenize import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                       TokenizeCompletionRequest, TokenizeResponse)
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.dp_client import (DATA_PARALLEL_RANK_HEADER, current_data_parallel_rank,
                                      parse_data_parallel_rank_header)


def attach_openai_routes(app: FastAPI, engine: AsyncLLM) -> None:
    """Add the routes (module docstring) to `app`, whose state holds the serving objects."""

    @app.get("/health")
    async def health() -> Response:
        # NOTE: 503 as vLLM's /health answers a dead engine (EngineDeadError), with the reason in an OpenAI body.
        if engine.errored:
            return error_response(f"The engine died: {engine.dead_error}", 503, "ServiceUnavailableError")
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": vllm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.stat_logger.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(app.state.models.show_available_models().model_dump())

    @app.post("/v1/completions", responses=route_responses(CompletionResponse))
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        with data_parallel_rank(raw_request, engine):
            handler = app.state.completion.create_completion(request)
            return respond(await cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/v1/chat/completions", responses=route_responses(ChatCompletionResponse))
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        with data_parallel_rank(raw_request, engine):
            handler = app.state.chat.create_chat_completion(request)
            return respond(await cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/inference/v1/generate", responses=route_responses(GenerateResponse))
    async def generate(request: GenerateRequest, raw_request: Request) -> Response:
        with data_parallel_rank(raw_request, engine):
            handler = app.state.generate.generate(request)
            return respond(await cancel_on_disconnect(raw_request, handler, app.state.drain))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(raw_request: Request) -> Response:
        # NOTE: the body's form (messages or prompt) picks the model, so that the other one never reports the
        # first one's fields as unknown.
        try:
            body = await raw_request.json()
        except ValueError as e:
            return error_response(f"The request body is not valid JSON: {e}", 400, "BadRequestError")
        model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
        try:
            request = model.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from e
        return respond(await app.state.tokenization.tokenize(request))

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return respond(await app.state.tokenization.detokenize(request))


@contextlib.contextmanager
def data_parallel_rank(raw: Request, engine: AsyncLLM) -> Iterator[None]:
    """While a generation route runs: the rank of its X-data-parallel-rank header (vLLM's) for the requests it adds
    (AsyncLLM.add_request reads it; the handler's task copies it). A bad value is a 400."""
    rank = parse_data_parallel_rank_header(raw.headers.get(DATA_PARALLEL_RANK_HEADER),
                                           engine.engine_core.data_parallel_size)
    token = current_data_parallel_rank.set(rank)
    try:
        yield
    finally:
        current_data_parallel_rank.reset(token)
