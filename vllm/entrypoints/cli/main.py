"""The `vllm` command: `vllm serve [MODEL] [flags]` starts the OpenAI-compatible server.

Engine flags come from AsyncEngineArgs.add_cli_args (vLLM's names); server flags from the API server. A bad flag
value (a config ValueError, e.g. --tensor-parallel-size 2) exits with status 2 and the message.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from vllm.engine.arg_utils import AsyncEngineArgs


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM-compatible LLM serving engine.")
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    serve = subparsers.add_parser("serve", help="Start the OpenAI-compatible HTTP server.",
                                  description="Start the OpenAI-compatible HTTP server.")
    from vllm.entrypoints.openai.api_server import add_frontend_args
    add_frontend_args(serve)
    AsyncEngineArgs.add_cli_args(serve)
    return parser


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from vllm.entrypoints.openai.api_server import loop_factory, run_api_servers, run_server
    try:
        AsyncEngineArgs.from_cli_args(args).create_engine_config()
    except ValueError as e:
        parser.error(str(e))
    if args.api_server_count < 1:
        parser.error(f"--api-server-count must be >= 1, got {args.api_server_count}")
    try:
        if args.api_server_count > 1:
            return run_api_servers(args)
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(run_server(args))
    except RuntimeError as e:
        logging.getLogger("vllm").error("%s", e)
        return 1


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.subcommand == "serve":
        sys.exit(serve(args, parser))


if __name__ == "__main__":
    main()
