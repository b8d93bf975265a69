"""The flags of `vllm serve`'s API server, and the checks of them that run before the engine starts.

`add_frontend_args` adds the server's own flags (the engine's come from EngineArgs); `check_frontend_args` checks
the ones that can be wrong (tool-call flags, --chat-template, the generation config's defaults), so that `vllm
serve` exits with status 2 and the message instead of failing after the engine started.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.graceful_shutdown import DEFAULT_SHUTDOWN_TIMEOUT_S
from vllm.entrypoints.openai.request_limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from vllm.entrypoints.openai.tool_parsers import get_tool_parser
from vllm.sampling_params import SamplingParams


def add_frontend_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--host", default="0.0.0.0", help="Host name to listen on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    parser.add_argument("--api-key", default=None,
                        help="Require this key in 'Authorization: Bearer <key>' on /v1 and /inference endpoints.")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level.")
    parser.add_argument("--enable-rl-endpoints", action="store_true", default=False,
                        help="Mount the admin endpoints of RL training loops (pause/resume, weight updates, "
                             "collective_rpc; docs/rl.md), as VLLM_SERVER_DEV_MODE=1 does. They load files and run "
                             "worker methods by name: trusted networks only.")
    parser.add_argument("--return-tokens-as-token-ids", action="store_true", default=False,
                        help="Name the tokens of logprobs 'token_id:{id}' instead of their text (for tokens that "
                             "are not valid UTF-8 alone); a request's return_tokens_as_token_ids overrides it.")
    parser.add_argument("--api-server-count", "-asc", type=int, default=1,
                        help="API server processes in front of the one engine core; more than 1 spreads the "
                             "per-token HTTP/JSON work of many concurrent streams over several CPU cores.")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="The largest request body accepted, in bytes; a larger one gets HTTP 413 before it is "
                             "read.")
    parser.add_argument("--trust-request-chat-template", action="store_true", default=False,
                        help="Accept a `chat_template` sent in a chat request (refused by default). It still renders "
                             "in the sandbox, with bounded work and output.")
    parser.add_argument("--chat-template", default=None,
                        help="The chat template: a file, or the Jinja template itself; the tokenizer's when not given.")
    parser.add_argument("--enable-auto-tool-choice", action="store_true", default=False,
                        help='Parse the tool calls of chat requests with tool_choice "auto" (or tools and no '
                             "tool_choice); needs --tool-call-parser.")
    parser.add_argument("--tool-call-parser", default=None,
                        help="The tool-call format of the model's output: hermes (<tool_call>{json}</tool_call>, the "
                             "Qwen2.5 / Qwen3 and Hermes models).")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", default=False,
                        help="Add usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                             "cache) to completions, chat and generate responses.")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="Seconds that running requests get to finish after SIGTERM / SIGINT; the rest then end "
                             "with an error (HTTP 503, or an error event and [DONE] when streamed).")
    return parser


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def default_sampling_params(model_config: Any) -> dict[str, Any]:
    """The generation config's defaults (ModelConfig.get_diff_sampling_param), checked once at start-up."""
    defaults = model_config.get_diff_sampling_param()
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"The model's generation config sets sampling defaults this engine refuses ({e}); start "
                         "with --generation-config vllm to ignore them.") from e
    return defaults


def check_frontend_args(args: argparse.Namespace, model_config: Any) -> None:
    """The server flags that can be wrong, checked before the engine starts (`vllm serve` exits with status 2 and
    the message): the tool-call flags, --chat-template, the generation config's defaults."""
    enable_auto_tool_choice = getattr(args, "enable_auto_tool_choice", False)
    tool_call_parser = getattr(args, "tool_call_parser", None)
    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser (this engine implements: hermes).")
    if tool_call_parser:
        get_tool_parser(tool_call_parser)
    load_chat_template(getattr(args, "chat_template", None))
    default_sampling_params(model_config)
