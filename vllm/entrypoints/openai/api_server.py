"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncLLM, under the module path vLLM users
know: `build_app`, `run_server`, `run_api_servers`, `make_vllm_config`, `loop_factory`, and
`python -m vllm.entrypoints.openai.api_server` (vLLM's older entry point, the same flags as `vllm serve`).

Endpoints: GET /v1/models, /health, /version, /metrics; POST /v1/completions, /v1/chat/completions,
/inference/v1/generate, /tokenize, /detokenize; with VLLM_SERVER_DEV_MODE=1 or --enable-rl-endpoints the admin
endpoints of RL training loops (admin.py: pause/resume, weight updates, collective_rpc). Errors are OpenAI-style
`{"error": {message, type, param, code}}`: invalid input 400 (validation errors included, never 422), unknown
model 404, missing or wrong key under --api-key 401, a dead engine or any unexpected error 500 (still an OpenAI
body); /health answers 503 once the engine died.

The server lives by idea, each module with its invariants:
- app.py: `build_app`, the app of one API server (state, middleware, handlers, routes);
- routes.py: the OpenAI and vLLM routes and the X-data-parallel-rank header; admin.py: the RL admin routes;
- http_errors.py: the OpenAI error bodies and the exception handlers; api_key.py: --api-key;
- http_responses.py: a handler cancelled when its client disconnects, streamed responses that close their stream;
- server.py: `run_server`, one API server process from start to exit code (signals, a dead engine core);
- api_server_group.py: `run_api_servers`, --api-server-count N > 1 processes on one port over shared cores;
- request_limits.py, graceful_shutdown.py, openapi.py: bounds before work, SIGTERM's grace, the OpenAPI schema.

Invariants:
- A request is fully validated before it reaches the engine core, so a bad request never disturbs the others.
- Bounds come before work (request_limits.py): a body over --max-request-body-bytes is a 413 before it is read, a
  text longer in characters than the context can hold is a 400 before it is tokenized, and long texts and chat
  templates are processed in a thread pool under a time bound, never on the event loop.
- A client that disconnects before its response (streaming or not) has its requests aborted in the engine.
- --data-parallel-size N: the frontend's AsyncLLM talks to N engine cores (dp_client.py); a generation request's
  X-data-parallel-rank header (vLLM's) picks its engine, else the least loaded one serves it.
- Every name this module had before the split stays importable from it, its private helpers under their old
  names too (tests/entrypoints/test_import_paths.py); code in this package imports from the modules above.
"""

from __future__ import annotations

from vllm.entrypoints.openai.api_server_group import run_api_servers
from vllm.entrypoints.openai.app import build_app
from vllm.entrypoints.openai.server import loop_factory, make_vllm_config, run_server

# The private helpers under their old names, for code that imported them from here (tests and tools did).
from vllm.entrypoints.openai.api_key import PROTECTED_PREFIXES as _PROTECTED_PREFIXES  # noqa: F401
from vllm.entrypoints.openai.api_key import APIKeyMiddleware as _APIKeyMiddleware  # noqa: F401
from vllm.entrypoints.openai.api_server_group import _api_server_proc, _listen, _stop  # noqa: F401
from vllm.entrypoints.openai.http_errors import error_response as _error  # noqa: F401
from vllm.entrypoints.openai.http_errors import validation_message as _validation_message  # noqa: F401
from vllm.entrypoints.openai.http_responses import SSEResponse as _SSEResponse  # noqa: F401
from vllm.entrypoints.openai.http_responses import _close_unsent_stream, _wait_for_disconnect  # noqa: F401
from vllm.entrypoints.openai.http_responses import cancel_on_disconnect as _cancel_on_disconnect  # noqa: F401
from vllm.entrypoints.openai.http_responses import respond as _respond  # noqa: F401
from vllm.entrypoints.openai.routes import data_parallel_rank as _data_parallel_rank  # noqa: F401
from vllm.entrypoints.openai.server import _stop_signals_absorbed, _watch_engine  # noqa: F401

__all__ = ["build_app", "loop_factory", "make_vllm_config", "run_api_servers", "run_server"]

if __name__ == "__main__":
    # NOTE: vLLM's older entry point; the same flags and server as `vllm serve` (vllm/entrypoints/cli/main.py).
    from vllm.entrypoints.cli.main import api_server_main
    api_server_main()
