"""The server's error answers: every error is an OpenAI body `{"error": {message, type, param, code}}`.

Invariants:
- Invalid input is a 400, FastAPI's validation errors included (never a 422); a field refused by name
  (request_fields.py) keeps its own message and `param`.
- An unknown model is a 404, a dead engine a 500, a server shutting down or a sleeping engine a 503, any other
  HTTP error its own status; an unexpected exception is a 500 with an OpenAI body (never Starlette's text/plain),
  logged with its traceback.
- A JSON body nested deeper than the interpreter's recursion limit is the client's input: a 400, not a 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.entrypoints.openai.serving_engine import NotFoundError, ServerShuttingDownError, error_body
from vllm.exceptions import VLLMValidationError
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.engine.sleep_mode import EngineSleepingError

# NOTE: the server's logger name from before the split (api_server.py), so log filters keep working.
logger = logging.getLogger("vllm.entrypoints.openai.api_server")


def error_response(message: str, status_code: int, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status_code, err_type, param), status_code=status_code)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The 400's message and `param` for a request FastAPI could not validate: the first error names the field,
    the message lists up to five."""
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, VLLMValidationError):  # a field refused by name (request_fields.py): its own message
        return str(cause), cause.parameter
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"The request body is not valid JSON: {first.get('msg', '')}", None
    details = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg')}"
                        for e in errors[:5])
    return f"Invalid request: {details}", param


def add_exception_handlers(app: FastAPI) -> None:
    """The app's exception handlers (module docstring)."""

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(message, 400, "BadRequestError", param)

    @app.exception_handler(ValueError)
    async def on_value_error(request: Request, exc: ValueError) -> JSONResponse:
        return error_response(str(exc), 400, "BadRequestError", getattr(exc, "parameter", None))

    @app.exception_handler(NotFoundError)
    async def on_not_found(request: Request, exc: NotFoundError) -> JSONResponse:
        return error_response(str(exc), 404, "NotFoundError", "model")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(f"The engine died: {exc}", 500, "InternalServerError")

    @app.exception_handler(ServerShuttingDownError)
    async def on_shutting_down(request: Request, exc: ServerShuttingDownError) -> JSONResponse:
        return error_response(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(EngineSleepingError)
    async def on_sleeping(request: Request, exc: EngineSleepingError) -> JSONResponse:
        return error_response(str(exc), 503, "ServiceUnavailableError")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code,
                              "NotFoundError" if exc.status_code == 404 else "HTTPError")

    @app.exception_handler(RecursionError)
    async def on_recursion_error(request: Request, exc: RecursionError) -> JSONResponse:
        # NOTE: json.loads raises it for a body nested deeper than the interpreter's recursion limit (the admin
        # endpoints parse their bodies themselves); that is the client's input, not a server fault.
        if "JSON" in str(exc):
            return error_response("The request body is nested too deeply to parse.", 400, "BadRequestError")
        return await on_unexpected_error(request, exc)

    @app.exception_handler(Exception)
    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: an OpenAI error body, never Starlette's text/plain 500.
        logger.exception("Unexpected error while handling %s %s", request.method, request.url.path)
        return error_response(f"Internal server error: {type(exc).__name__}: {exc}", 500, "InternalServerError")
