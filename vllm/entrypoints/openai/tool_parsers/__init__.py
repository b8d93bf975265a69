"""Tool-call parsers of the chat endpoint (`--enable-auto-tool-choice --tool-call-parser NAME`), by vLLM's names.

A parser turns a choice's generated text into `message.tool_calls` (whole response) or `delta.tool_calls`
(streamed). Only `hermes` (`<tool_call>{json}</tool_call>`, the format of the Qwen2.5 / Qwen3 and Hermes models)
is implemented; another name is refused at start-up.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.hermes_tool_parser import (ExtractedToolCallInformation,
                                                                     Hermes2ProToolParser, HermesStreamState)

TOOL_PARSERS: dict[str, type[Hermes2ProToolParser]] = {"hermes": Hermes2ProToolParser}


def get_tool_parser(name: str) -> type[Hermes2ProToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not available; this engine implements: "
                         f"{', '.join(sorted(TOOL_PARSERS))}.")
    return TOOL_PARSERS[name]


__all__ = ["ExtractedToolCallInformation", "Hermes2ProToolParser", "HermesStreamState", "TOOL_PARSERS",
           "get_tool_parser"]
