"""The `vllm` command: `vllm serve [MODEL] [flags]` starts the OpenAI-compatible server; `vllm --version`.

Engine flags come from AsyncEngineArgs.add_cli_args (vLLM's names); server flags from the API server; `--help`
shows each flag's default. `python -m vllm.entrypoints.openai.api_server [MODEL] [flags]` (vLLM's older entry
point, `api_server_main`) takes the same flags and serves the same way. A bad flag value (a config ValueError,
e.g. --tensor-parallel-size 2) exits with status 2 and the message.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

import vllm
from vllm.engine.arg_utils import AsyncEngineArgs

_SERVE_DESCRIPTION = "Start the OpenAI-compatible HTTP server."


def _configure_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of `vllm serve`: the API server's, then the engine's."""
    from vllm.entrypoints.openai.cli_args import add_frontend_args
    add_frontend_args(parser)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM-compatible LLM serving engine.")
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    subparsers = parser.add_subparsers(dest="subcommand", required=True)
    serve_parser = subparsers.add_parser("serve", help=_SERVE_DESCRIPTION, description=_SERVE_DESCRIPTION,
                                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(serve_parser)
    return parser


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from vllm.entrypoints.openai.api_server_group import run_api_servers
    from vllm.entrypoints.openai.server import loop_factory, run_server
    from vllm.entrypoints.openai.cli_args import check_frontend_args
    from vllm.v1.engine.core_launch import device_env
    try:
        vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
        check_frontend_args(args, vllm_config.model_config)
        device_env(vllm_config)  # NOTE: enough devices for every data-parallel engine, checked before any starts
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
    _configure_logging()
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.subcommand == "serve":
        sys.exit(serve(args, parser))


def api_server_main(argv: list[str] | None = None) -> None:
    """`python -m vllm.entrypoints.openai.api_server [MODEL] [flags]`: `vllm serve` under vLLM's older name."""
    _configure_logging()
    parser = argparse.ArgumentParser(prog="python -m vllm.entrypoints.openai.api_server",
                                     description=_SERVE_DESCRIPTION,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(parser)
    sys.exit(serve(parser.parse_args(argv), parser))


if __name__ == "__main__":
    main()
