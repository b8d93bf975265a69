"""The server's OpenAPI schema, made to say what the server does.

FastAPI documents a 422 with its own validation-error body for every route that takes a model; this server
answers invalid input with a 400 and the OpenAI error body (http_errors.py's handlers), so the generated schema
drops the 422 and its schemas, and each generation route lists its real answers: 200 as JSON or, with
`"stream": true`, Server-Sent Events; 400, 401, 404, 413, 500 and 503 with the OpenAI error body. The request
models mark the fields a request must send and the bounds the server enforces (protocol_base.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from vllm.entrypoints.openai.protocol_base import ErrorResponse

_ERRORS = {
    400: "Invalid request: a missing or malformed field, a value out of range, a prompt too long for the context.",
    401: "A valid API key is required (--api-key).",
    404: "The model is not served here.",
    413: "The request body is larger than --max-request-body-bytes.",
    500: "Internal error (the engine died).",
    503: "The server is shutting down, or the engine is asleep (sleep mode).",
}


# One Server-Sent Event of a stream (OpenAPI 3.2's itemSchema; the stream as a whole is the array of its events, as
# schemathesis reads it): `data` is a chunk's JSON text, or `[DONE]`.
_SSE_EVENT: dict[str, Any] = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
    "retry": {"type": "integer"}}}

def route_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a generation route: its JSON body, its SSE stream and the OpenAI errors."""
    responses: dict[int | str, dict[str, Any]] = {200: {
        "model": model, "description": "The whole response (JSON), or with `stream: true` Server-Sent Events: "
                                       "`data: {chunk}` per chunk, then `data: [DONE]`.",
        "content": {"text/event-stream": {"schema": {"type": "array", "items": _SSE_EVENT},
                                                "itemSchema": _SSE_EVENT}}}}
    for code, description in _ERRORS.items():
        responses[code] = {"model": ErrorResponse, "description": description}
    return responses


def documented_openapi(app: FastAPI) -> dict[str, Any]:
    """The app's OpenAPI schema without FastAPI's 422 (module docstring); built once."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            if isinstance(operation, dict):
                operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    app.openapi_schema = schema
    return schema
