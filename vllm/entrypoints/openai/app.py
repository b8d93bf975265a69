"""The FastAPI app of one API server in front of an AsyncLLM (`build_app`): the serving objects on `app.state`,
the middleware, the error handlers and the routes.

Invariants:
- The request guard (request_limits.py) is the outermost middleware: body sizes and draining are checked before
  anything else runs, the API key (api_key.py) next.
- Every error is an OpenAI body (http_errors.py); the OpenAPI schema documents the server's 400s and bounds
  (openapi.py).
- The admin routes of RL training loops (admin.py) exist only with enable_rl_endpoints (--enable-rl-endpoints) or
  VLLM_SERVER_DEV_MODE=1.
- Configuration errors (--enable-auto-tool-choice without a parser) are refused before anything is built.
"""

from __future__ import annotations

from fastapi import FastAPI

import vllm
from vllm import envs
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.admin import attach_admin_router
from vllm.entrypoints.openai.api_key import APIKeyMiddleware
from vllm.entrypoints.openai.cli_args import default_sampling_params
from vllm.entrypoints.openai.graceful_shutdown import ServerDrain
from vllm.entrypoints.openai.http_errors import add_exception_handlers, error_response
from vllm.entrypoints.openai.openapi import documented_openapi
from vllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BODY_BYTES, PreprocessPool, RequestGuard
from vllm.entrypoints.openai.routes import attach_openai_routes
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.serving_generate import OpenAIServingGenerate
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.v1.engine.async_llm import AsyncLLM


def build_app(engine: AsyncLLM, api_key: str | None = None, enable_rl_endpoints: bool = False, *,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              trust_request_chat_template: bool = False, chat_template: str | None = None,
              enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
              return_tokens_as_token_ids: bool = False,
              enable_prompt_tokens_details: bool = False) -> FastAPI:
    """The app; the admin endpoints of RL training loops (admin.py) only with enable_rl_endpoints or
    VLLM_SERVER_DEV_MODE=1. chat_template: --chat-template (a file or the template itself)."""
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (this engine implements: hermes).")
    tool_parser = get_tool_parser(tool_call_parser) if enable_auto_tool_choice and tool_call_parser else None
    app = FastAPI(title="vllm", version=vllm.__version__)
    mc = engine.model_config
    names = [mc.served_model_name or str(mc.model)]
    app.state.engine = engine
    app.state.drain = ServerDrain()
    app.state.preprocess = preprocess = PreprocessPool()
    app.state.models = OpenAIServingModels(names, str(mc.model), int(mc.max_model_len or 0))
    app.state.completion = OpenAIServingCompletion(engine, names, preprocess)
    app.state.chat = OpenAIServingChat(engine, names, preprocess, trust_request_chat_template,
                                       load_chat_template(chat_template), tool_parser)
    app.state.generate = OpenAIServingGenerate(engine, names, preprocess)
    app.state.tokenization = OpenAIServingTokenization(app.state.chat)
    app.state.completion.default_sampling_params = app.state.chat.default_sampling_params = \
        default_sampling_params(mc)
    for serving in (app.state.completion, app.state.chat, app.state.generate):
        serving.return_tokens_as_token_ids = return_tokens_as_token_ids
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    # NOTE: added last, so outermost: sizes and draining are checked before anything else runs.
    app.add_middleware(RequestGuard, max_body_bytes=max_request_body_bytes,
                       draining=lambda: app.state.drain.draining, error=error_response)
    add_exception_handlers(app)
    if enable_rl_endpoints or envs.VLLM_SERVER_DEV_MODE:
        attach_admin_router(app, engine)
    attach_openai_routes(app, engine)
    app.openapi = lambda: documented_openapi(app)  # type: ignore[method-assign]
    return app
