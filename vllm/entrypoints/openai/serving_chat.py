"""POST /v1/chat/completions: messages through the chat template, JSON or SSE, with logprobs and masks.

Streaming sends a first chunk with the assistant role per choice, then one chunk per choice and engine step
(its text, token ids when asked, logprobs and the masks of its tokens), an optional usage chunk, and
`data: [DONE]`. With `n` samples, choice j is the request's sample j (`CompletionOutput.index`).

Every string of the messages and of `chat_template_kwargs` must be valid Unicode (checked before the template
runs), and `max_tokens` / `max_completion_tokens` must fit the context the rendered prompt leaves (vLLM's 400),
both checked before the request is added. A request's own `chat_template` is refused unless the server runs with
--trust-request-chat-template; it then renders in the preprocess pool under the sandbox's step budget
(template_sandbox.py), as does the server's template for a large conversation or any chat_template_kwargs; the
rendered prompt is checked in characters against the context before it is tokenized (request_limits.py).

Tools (vLLM's rules): `tools` go to the chat template (chat_utils.render_chat). `tool_choice` defaults to "auto"
when tools are sent, else "none"; "auto" needs the server's --enable-auto-tool-choice and --tool-call-parser (else
a 400 naming it, vLLM's message) and then parses each choice's text (tool_parsers/): `message.tool_calls` and
finish_reason "tool_calls" when the model called a tool, `delta.tool_calls` when streamed, with special tokens
kept in the text (the parser reads them). "required" and a named function need structured outputs, which this
engine does not implement: a 400 naming the value. Requests' unset sampling fields take the model's generation
config defaults (OpenAIServing.with_defaults).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from vllm.entrypoints.chat_utils import render_chat
from vllm.entrypoints.openai.protocol_chat import (ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatCompletionResponseChoice, ChatCompletionResponseStreamChoice,
                                                   ChatCompletionStreamResponse, ChatMessage, DeltaMessage)
from vllm.entrypoints.openai.tool_parsers import Hermes2ProToolParser, HermesStreamState
from vllm.entrypoints.openai.request_limits import INLINE_CHARS, PreprocessPool, prompt_char_limit
from vllm.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIServing, SplicedJSONResponse, SSEStream, mask_texts,
                                                    prompt_logprobs_json, sse, weight_spans, with_mask_texts)
from vllm.exceptions import VLLMValidationError
from vllm.outputs import RequestOutput
from vllm.sampling_params import check_unicode
from vllm.transformers_utils.template_sandbox import MAX_TEMPLATE_STEPS
from vllm.utils import random_uuid
from vllm.v1.engine.async_llm import AsyncLLM, OutputStream
from vllm.v1.engine.input_processor import check_max_tokens


# Arguments of Tokenizer.apply_chat_template that a request's chat_template_kwargs must not replace.
_RESERVED_TEMPLATE_KWARGS = frozenset(("messages", "tokenize", "add_generation_prompt", "chat_template", "max_steps",
                                       "timeout_s", "max_chars", "cache_template"))
# The longest chat_template a request may send (model templates are a few KiB; compiling one takes memory and
# time in proportion to its size, outside the step budget).
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024


def check_strings(value: Any, parameter: str) -> None:
    """Every string inside a JSON value (keys included) is valid Unicode; the first that is not is named by its
    path, e.g. `messages[0].content[1].text`."""
    if isinstance(value, str):
        check_unicode(value, parameter)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                check_unicode(key, parameter)
            check_strings(item, f"{parameter}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_strings(item, f"{parameter}[{i}]")


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise VLLMValidationError("Only text content parts ({'type': 'text', 'text': ...}) are supported.",
                                          parameter="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise VLLMValidationError("A message's content must be a string or a list of text parts.",
                              parameter="messages")


def normalize_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise VLLMValidationError("messages must be a non-empty list.", parameter="messages")
    check_strings(messages, "messages")
    out = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if not isinstance(role, str) or role not in ("system", "user", "assistant", "tool", "developer"):
            raise VLLMValidationError(f"messages[{i}].role must be one of system, user, assistant, tool, "
                                      f"developer; got {role!r}.", parameter=f"messages[{i}].role")
        out.append({**message, "content": _message_text(message.get("content"))})
    return out


def resolve_tool_choice(request: ChatCompletionRequest, tool_parser: type[Hermes2ProToolParser] | None) -> str:
    """The request's tool choice, "none" or "auto" (module docstring); a 400 for what cannot be served."""
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools else "none"
    if choice == "none":
        return "none"
    if not request.tools:
        raise VLLMValidationError("When using `tool_choice`, `tools` must be set.", parameter="tool_choice")
    if choice == "auto":
        if tool_parser is None:
            raise VLLMValidationError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                      "to be set", parameter="tool_choice")
        return "auto"
    what = "tool_choice='required'" if choice == "required" else \
        f"tool_choice naming the function {choice.function.name!r}"  # type: ignore[union-attr]
    raise VLLMValidationError(f"{what} is not supported: it needs structured outputs (guided decoding), which this "
                              'engine does not implement; use tool_choice "auto" or "none".', parameter="tool_choice")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], preprocess: PreprocessPool | None = None,
                 trust_request_chat_template: bool = False, chat_template: str | None = None,
                 tool_parser: type[Hermes2ProToolParser] | None = None) -> None:
        super().__init__(engine, served_model_names, preprocess)
        self.trust_request_chat_template = trust_request_chat_template
        # --chat-template (already read: chat_utils.load_chat_template); None: the tokenizer's
        self.chat_template = chat_template
        # --enable-auto-tool-choice with --tool-call-parser; None without it
        self.tool_parser = tool_parser

    async def _prompt_token_ids(self, request: Any) -> list[int]:
        """The prompt of a chat request (or a /tokenize request with messages): its messages through the chat
        template, tokenized."""
        if self.tokenizer is None:
            raise VLLMValidationError("Chat needs a tokenizer, but the server runs with --skip-tokenizer-init.",
                                      parameter="messages")
        if request.chat_template is not None and not self.trust_request_chat_template:
            raise VLLMValidationError("Chat templates sent in requests are refused: this server renders its own "
                                      "(start it with --trust-request-chat-template to accept them).",
                                      parameter="chat_template")
        if request.chat_template is not None and len(request.chat_template) > MAX_REQUEST_TEMPLATE_CHARS:
            raise VLLMValidationError(f"chat_template has {len(request.chat_template)} characters, more than the "
                                      f"{MAX_REQUEST_TEMPLATE_CHARS} a request's template may have.",
                                      parameter="chat_template")
        messages = normalize_messages(request.messages)
        check_strings(request.chat_template_kwargs, "chat_template_kwargs")
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(request.chat_template_kwargs or {}))
        if reserved:
            raise VLLMValidationError(f"chat_template_kwargs cannot set {reserved[0]!r}; it has a field of its own "
                                      "or is the server's.", parameter=f"chat_template_kwargs.{reserved[0]}")
        # NOTE: no value the template builds may be longer than the prompt the context can hold (what is longer
        # is refused after rendering anyway); that also bounds the memory a template can take.
        max_chars = prompt_char_limit(self.max_model_len, self.tokenizer.max_token_chars)
        tools = [tool.model_dump() for tool in request.tools] if request.tools is not None else None
        check_strings(tools, "tools")
        render = functools.partial(
            render_chat, self.tokenizer, messages, add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=request.chat_template if request.chat_template is not None else self.chat_template,
            tools=tools, documents=getattr(request, "documents", None),
            chat_template_kwargs=request.chat_template_kwargs, max_chars=max_chars,
            cache_template=request.chat_template is None)
        try:
            if request.chat_template is not None:
                # NOTE: a request's template runs in the pool under a step budget (template_sandbox.py).
                rendered = await self.preprocess.run(
                    "Rendering the chat template", "chat_template", render, max_steps=MAX_TEMPLATE_STEPS,
                    timeout_s=self.preprocess.timeout_s)
            elif request.chat_template_kwargs or sum(len(m["content"]) for m in messages) > INLINE_CHARS:
                rendered = await self.preprocess.run("Rendering the chat template", "messages", render)
            else:
                rendered = render()
        except VLLMValidationError:
            raise
        except ValueError as e:  # the template refused the messages, or is not valid Jinja, or broke a bound
            raise VLLMValidationError(str(e), parameter="chat_template" if request.chat_template is not None
                                      else "messages") from e
        except Exception as e:
            raise VLLMValidationError(f"The chat template failed on these messages: {type(e).__name__}: {e}",
                                      parameter="messages") from e
        assert isinstance(rendered, str)
        # NOTE: the template writes the BOS itself when the model wants one (add_special_tokens defaults to False).
        return await self.encode(rendered, request.add_special_tokens, "messages")

    async def create_chat_completion(self, request: ChatCompletionRequest
                                     ) -> ChatCompletionResponse | SplicedJSONResponse | SSEStream:
        model = self.model_name(request.model)
        parser = self.tool_parser(request.parallel_tool_calls is not False) \
            if resolve_tool_choice(request, self.tool_parser) == "auto" else None
        request = self.with_defaults(request)
        if parser is not None:
            # NOTE: vLLM's hermes parser keeps special tokens in the text (its tags may be special tokens).
            request = request.model_copy(update={"skip_special_tokens": False})
        params = request.to_sampling_params()
        prompt_ids = await self._prompt_token_ids(request)
        check_max_tokens(params.max_tokens, len(prompt_ids), self.max_model_len)
        engine_id = f"chatcmpl-{random_uuid()}"
        request_id = f"chatcmpl-{request.request_id}" if request.request_id else engine_id
        prompt: dict[str, Any] = {"prompt_token_ids": prompt_ids}
        if request.cache_salt is not None:
            prompt["cache_salt"] = request.cache_salt
        queue = await self.engine.add_request(engine_id, prompt, params)
        gen = self.engine.stream_outputs(engine_id, queue)
        if request.stream:
            return SSEStream(self._stream(request, model, request_id, gen, parser), [gen])
        final: RequestOutput | None = None
        async for out in gen:
            final = out
        assert final is not None
        outputs = sorted(final.outputs, key=lambda c: c.index)
        texts = mask_texts(outputs)
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        choices = [ChatCompletionResponseChoice(
            index=c.index, message=(message := _message(c.text, parser)),
            finish_reason="tool_calls" if message.tool_calls else c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, as_ids)
            if request.logprobs else None,
            token_ids=list(c.token_ids) if request.return_token_ids else None,
            sampling_mask=c.sampling_mask.token_ids if c.sampling_mask is not None and text is None else None,
            weight_versions=weight_spans(c))
            for c, text in zip(outputs, texts)]
        num_prompt = len(final.prompt_token_ids or [])
        num_completion = sum(len(c.token_ids) for c in final.outputs)
        usage = self.usage(num_prompt, num_completion, final.num_cached_tokens or 0)
        return with_mask_texts(ChatCompletionResponse(
            id=request_id, model=model, choices=choices, usage=usage,
            prompt_token_ids=list(prompt_ids) if request.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_json(final.prompt_logprobs)), texts)

    async def _stream(self, request: ChatCompletionRequest, model: str, request_id: str, gen: OutputStream,
                      parser: Hermes2ProToolParser | None = None) -> AsyncGenerator[bytes, None]:
        states: dict[int, HermesStreamState] = {}
        for index in range(request.n):
            yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[
                ChatCompletionResponseStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))]))
        num_prompt = num_completion = num_cached = 0
        as_ids = self.tokens_as_ids(request.return_tokens_as_token_ids)
        async for out in gen:
            num_prompt = len(out.prompt_token_ids or [])
            num_cached = out.num_cached_tokens or num_cached
            for c in out.outputs:
                num_completion += len(c.token_ids)
                delta, finish_reason = DeltaMessage(content=c.text), c.finish_reason
                if parser is not None:
                    delta, finish_reason = _tool_delta(states.setdefault(c.index, parser.stream_state()), c.text,
                                                       finish_reason)
                choice = ChatCompletionResponseStreamChoice(
                    index=c.index, delta=delta, finish_reason=finish_reason,
                    stop_reason=c.stop_reason,
                    logprobs=self.chat_logprobs(c.token_ids, c.logprobs, request.top_logprobs or 0, as_ids)
                    if request.logprobs else None,
                    token_ids=list(c.token_ids) if request.return_token_ids else None,
                    weight_versions=weight_spans(c))
                chunk = ChatCompletionStreamResponse(id=request_id, model=model, choices=[choice])
                text = c.sampling_mask.json_text() if c.sampling_mask is not None else None
                if text is None:
                    choice.sampling_mask = c.sampling_mask.token_ids if c.sampling_mask is not None else None
                    yield sse(chunk)
                else:
                    # NOTE: the engine's JSON text of the masks goes in as it is (as in streamed completions),
                    # instead of hundreds of Python ints per token through pydantic.
                    body = chunk.model_dump()
                    body["choices"][0]["sampling_mask"] = msgspec.Raw(text)
                    yield sse(body)
        if request.stream_options is not None and request.stream_options.include_usage:
            usage = self.usage(num_prompt, num_completion, num_cached)
            yield sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage))
        yield SSE_DONE


def _message(text: str, parser: Hermes2ProToolParser | None) -> ChatMessage:
    """The assistant message of a whole response: the text, or its tool calls and the content before them."""
    if parser is None:
        return ChatMessage(role="assistant", content=text)
    info = parser.extract_tool_calls(text)
    return ChatMessage(role="assistant", content=info.content, tool_calls=info.tool_calls or None)


def _tool_delta(state: HermesStreamState, text: str, finish_reason: str | None) -> tuple[DeltaMessage, str | None]:
    """A streamed chunk's delta (content and/or tool calls) and its finish_reason, "tool_calls" at the end of a
    choice that called a tool."""
    content, calls = state.feed(text)
    if finish_reason is not None:
        rest, more = state.finish()
        content = (content or "") + (rest or "") or None
        calls += more
        if state.tools_called:
            finish_reason = "tool_calls"
    return DeltaMessage(content=content, tool_calls=calls or None), finish_reason
