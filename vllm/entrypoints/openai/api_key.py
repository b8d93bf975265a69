"""--api-key: the OpenAI and inference routes (/v1, /inference) answer 401 without `Authorization: Bearer <key>`.

Invariants:
- Only those prefixes are guarded (the health, metrics, tokenize and admin routes are not; admin.py says why the
  admin routes need a trusted network), and OPTIONS requests pass.
- The key is compared in constant time (hmac.compare_digest).
- A plain ASGI middleware: the app's own send and receive pass through untouched (Starlette's BaseHTTPMiddleware
  would run each response in another task and relay every streamed event through a queue).
"""

from __future__ import annotations

import hmac
from typing import Any

from vllm.entrypoints.openai.http_errors import error_response

PROTECTED_PREFIXES = ("/v1", "/inference")


class APIKeyMiddleware:
    """A request to /v1 or /inference without `Authorization: Bearer <key>` gets a 401 (module docstring)."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()  # ASGI header values are bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"].startswith(PROTECTED_PREFIXES)
                and not hmac.compare_digest(
                    next((v for k, v in scope["headers"] if k == b"authorization"), b""), self.expected)):
            response = error_response("Unauthorized: a valid API key is required.", 401, "AuthenticationError")
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
