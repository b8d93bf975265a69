"""The Hermes tool-call format (`--tool-call-parser hermes`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
as the Qwen2.5 / Qwen3 and NousResearch Hermes chat templates ask the model to write.

Whole responses (`extract_tool_calls`, vLLM's rule): without `<tool_call>` the text is the content. Otherwise
every `<tool_call>...</tool_call>` (the last one may be left unclosed at the end of the text) is a call: its JSON
object's `name`, and its `arguments` written back as a JSON string (non-ASCII kept); the content is the text
before the first `<tool_call>`, or None when that is empty. If any call is not such a JSON object, nothing is a
call and the whole text is the content.

Streams (`HermesStreamState`, one per choice): text before the first `<tool_call>` streams as content (a tail that
could begin `<tool_call>` is held back until the next delta decides it); each call is sent once its
`</tool_call>` arrives (or at the end of the stream, unclosed), as one `DeltaToolCall` with its index, id, type,
name and whole arguments string (vLLM sends the arguments in several pieces; clients that concatenate by index get
the same result). Text after the first call is not content, as in a whole response; a call whose JSON does not
parse streams as content instead.

With `parallel_tool_calls=false` only the first call is returned.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from vllm.entrypoints.openai.protocol_chat import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from vllm.utils import random_uuid

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{random_uuid()}"


@dataclass
class ExtractedToolCallInformation:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


def _parse_call(body: str) -> FunctionCall:
    """One call's JSON object -> FunctionCall; ValueError / KeyError / TypeError when it is not one."""
    call = json.loads(body)
    if not isinstance(call, dict) or not isinstance(call["name"], str):
        raise ValueError("a tool call must be a JSON object with a string name")
    return FunctionCall(name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False))


class Hermes2ProToolParser:
    """vLLM's class name for the hermes parser (module docstring)."""

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.parallel_tool_calls = parallel_tool_calls

    def extract_tool_calls(self, model_output: str) -> ExtractedToolCallInformation:
        if TOOL_CALL_START not in model_output:
            return ExtractedToolCallInformation(False, [], model_output)
        try:
            calls = [_parse_call(closed or unclosed) for closed, unclosed in _TOOL_CALL_RE.findall(model_output)]
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("Error in extracting tool call from response (%s); returned as content.", e)
            return ExtractedToolCallInformation(False, [], model_output)
        if not self.parallel_tool_calls:
            calls = calls[:1]
        content = model_output[:model_output.find(TOOL_CALL_START)]
        return ExtractedToolCallInformation(True, [ToolCall(id=make_tool_call_id(), function=f) for f in calls],
                                            content or None)

    def stream_state(self) -> HermesStreamState:
        return HermesStreamState(self.parallel_tool_calls)


def _held_back(text: str) -> int:
    """How many trailing characters of `text` could be the start of TOOL_CALL_START."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


@dataclass
class HermesStreamState:
    """The streamed parse of one choice (module docstring)."""

    parallel_tool_calls: bool = True
    buffer: str = ""
    in_call: bool = False
    num_calls: int = 0
    seen_call: bool = False

    @property
    def tools_called(self) -> bool:
        return self.num_calls > 0

    def feed(self, delta_text: str) -> tuple[str | None, list[DeltaToolCall]]:
        """The content and tool-call deltas `delta_text` completes."""
        self.buffer += delta_text
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(TOOL_CALL_START)
                if start < 0:
                    keep = _held_back(self.buffer)
                    if not self.seen_call:
                        content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                if not self.seen_call:
                    content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_START):]
                self.in_call = self.seen_call = True
            else:
                end = self.buffer.find(TOOL_CALL_END)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(TOOL_CALL_END):]
                self.in_call = False
                self._emit(body, closed=True, content=content, calls=calls)
        text = "".join(content)
        return (text or None), calls

    def finish(self) -> tuple[str | None, list[DeltaToolCall]]:
        """What is left at the end of the stream: an unclosed call, or a held-back tail."""
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        if self.in_call:
            self._emit(self.buffer, closed=False, content=content, calls=calls)
        elif not self.seen_call:
            content.append(self.buffer)
        self.buffer = ""
        self.in_call = False
        text = "".join(content)
        return (text or None), calls

    def _emit(self, body: str, closed: bool, content: list[str], calls: list[DeltaToolCall]) -> None:
        try:
            function = _parse_call(body)
        except (ValueError, KeyError, TypeError):
            content.append(TOOL_CALL_START + body + (TOOL_CALL_END if closed else ""))
            return
        if self.num_calls > 0 and not self.parallel_tool_calls:
            return
        calls.append(DeltaToolCall(index=self.num_calls, id=make_tool_call_id(), type="function",
                                   function=DeltaFunctionCall(name=function.name, arguments=function.arguments)))
        self.num_calls += 1

