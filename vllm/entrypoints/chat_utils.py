"""Chat prompt rendering shared by LLM.chat, the chat endpoint and /tokenize (vLLM's module name).

- `load_chat_template(value)`: `--chat-template` as vLLM reads it: a file's contents when `value` opens as a file,
  else the value itself as a Jinja template when it has a Jinja character (`{`, `}` or a newline), else an error
  (it looks like a path that does not open).
- `render_chat(...)`: the conversation through the chat template with vLLM's options: `add_generation_prompt`,
  `continue_final_message` (the prompt ends right after the final message's content, left open for the model
  to continue; both at once is an error, as in vLLM), `tools` (a list of tool dicts, the template's `tools`
  variable), `documents`, and `chat_template_kwargs` (more template variables). As in vLLM, an assistant
  message's `tool_calls[*].function.arguments` reach the template as a dict: OpenAI clients send them as a JSON
  string, tool-use templates (Qwen's among them) write them with `| tojson` (a copy is changed, not the caller's).
"""

from __future__ import annotations

import json
from typing import Any

from vllm.exceptions import VLLMValidationError
from vllm.transformers_utils.tokenizer import Tokenizer

_JINJA_CHARS = "{}\n"


def load_chat_template(chat_template: str | None) -> str | None:
    """A template file's contents, or the inline template itself (module docstring)."""
    if chat_template is None:
        return None
    try:
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if not any(c in chat_template for c in _JINJA_CHARS):
            raise ValueError(f"The chat template {chat_template!r} looks like a file path, but it cannot be opened: "
                             f"{e}") from e
        return chat_template


def check_chat_options(add_generation_prompt: bool, continue_final_message: bool,
                       messages: list[dict[str, Any]]) -> None:
    if add_generation_prompt and continue_final_message:
        raise VLLMValidationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                                  parameter="continue_final_message")
    if continue_final_message and (not messages or not isinstance(messages[-1].get("content"), str)
                                   or not messages[-1]["content"]):
        raise VLLMValidationError("continue_final_message needs a final message with text content to continue.",
                                  parameter="continue_final_message")


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                tools: list[dict[str, Any]] | None = None, documents: list[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None, **bounds: Any) -> str:
    """The rendered prompt text (module docstring). `bounds`: Tokenizer.apply_chat_template's limits (max_steps,
    timeout_s, max_chars, cache_template)."""
    check_chat_options(add_generation_prompt, continue_final_message, messages)
    messages = tool_call_arguments_as_dicts(messages)
    variables = dict(chat_template_kwargs or {})
    if tools is not None:
        variables["tools"] = tools
    if documents is not None:
        variables["documents"] = documents
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **bounds, **variables)
    assert isinstance(rendered, str)
    if continue_final_message:
        final = messages[-1]["content"]
        end = rendered.rfind(final)
        if end < 0:
            raise VLLMValidationError("continue_final_message: the chat template does not write the final "
                                      "message's content as it is, so it cannot be left open.",
                                      parameter="continue_final_message")
        rendered = rendered[:end + len(final)]
    return rendered


def tool_call_arguments_as_dicts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with each assistant tool call's JSON-string arguments parsed (module docstring); an empty or
    missing one becomes {}. Messages without tool calls are passed as they are."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") != "assistant" or not isinstance(calls, list):
            out.append(message)
            continue
        parsed_calls = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise VLLMValidationError(f"messages[{i}].tool_calls[{j}] must be an object with a `function`.",
                                          parameter=f"messages[{i}].tool_calls[{j}]")
            arguments = function.get("arguments")
            if not arguments:
                arguments = {}
            elif isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError as e:
                    raise VLLMValidationError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: "
                                              f"{e}", parameter=f"messages[{i}].tool_calls[{j}].function.arguments") \
                        from None
            parsed_calls.append({**call, "function": {**function, "arguments": arguments}})
        out.append({**message, "tool_calls": parsed_calls})
    return out
