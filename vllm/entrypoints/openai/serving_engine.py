"""OpenAIServing: what the completion, chat and generate handlers share (model check, errors, logprobs, SSE).

Errors are raised as exceptions and turned into OpenAI-style bodies by the server's exception handlers:
ValueError -> 400 (a VLLMValidationError's `parameter` becomes the body's `param`), `NotFoundError` -> 404,
EngineDeadError -> 500, ServerShuttingDownError and EngineSleepingError -> 503. Bounds that need the prompt's length (`check_max_tokens`)
are checked by the handlers before a request is added; texts are checked against the context in characters before
they are tokenized, and long ones are tokenized in the preprocess pool (request_limits.py), off the event loop.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import msgspec
from pydantic import BaseModel
from starlette.responses import Response

from vllm.outputs import CompletionOutput, Logprob
from vllm.transformers_utils.tokenizer import Tokenizer
from vllm.v1.engine.async_llm import AsyncLLM, OutputStream
from vllm.v1.engine.core_client import EngineDeadError
from vllm.v1.engine.sleep_mode import EngineSleepingError
from vllm.entrypoints.openai.request_limits import INLINE_CHARS, PreprocessPool, check_prompt_chars
from vllm.entrypoints.openai.protocol_base import ErrorInfo, ErrorResponse, PromptTokenUsageInfo, UsageInfo
from vllm.entrypoints.openai.protocol_chat import (ChatCompletionLogProb, ChatCompletionLogProbs,
                                                   ChatCompletionLogProbsContent)


class NotFoundError(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


class ServerShuttingDownError(Exception):
    """The server stopped while the request ran, after the shutdown grace (HTTP 503, or an error event)."""


def error_body(message: str, status_code: int, err_type: str, param: str | None = None) -> dict:
    """An OpenAI error body. A message or param that echoes a client's string may hold a lone surrogate, which no
    JSON encoder writes as UTF-8: such characters are escaped ("\\ud800"), so the error itself never fails."""
    return ErrorResponse(error=ErrorInfo(message=_printable(message), type=err_type,
                                         param=None if param is None else _printable(param),
                                         code=status_code)).model_dump()


def _printable(text: str) -> str:
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_json_encoder = msgspec.json.Encoder()


def sse(obj: BaseModel | dict) -> bytes:
    """One server-sent event, as the bytes the response streams. Plain dicts (the hot streaming path) are encoded
    by msgspec, models by pydantic.

    NOTE: bytes, not str: a str chunk is decoded from the encoder's bytes here and encoded again by the response,
    two more copies of every chunk (~3.6 KB per token with a sampling mask's text in it)."""
    if isinstance(obj, dict):  # NOTE: tested first: isinstance against BaseModel (an ABC) costs more
        return b"".join((b"data: ", _json_encoder.encode(obj), b"\n\n"))
    return b"".join((b"data: ", obj.model_dump_json(exclude_none=False).encode(), b"\n\n"))


SSE_DONE = b"data: [DONE]\n\n"


def weight_spans(c: CompletionOutput) -> list[dict[str, Any]] | None:
    """The choice's `weight_versions` field: its [version, start, end] spans as objects; None until the engine's
    weights were named (responses stay as they were without RL weight updates)."""
    spans = c.weight_versions
    if not spans:
        return None
    return [{"weight_version": v, "start": s, "end": e} for v, s, e in spans]


def mask_texts(outputs: Sequence[CompletionOutput]) -> list[list[Any] | None]:
    """Each output's masks as the engine's JSON text (SamplingMask.json_parts), for with_mask_texts (None: no
    masks, or no text: the masks then go in as lists)."""
    return [c.sampling_mask.json_parts() if c.sampling_mask is not None else None for c in outputs]


# Where a mask's text goes in the encoded body: a NUL byte, which the JSON encoder never writes itself (control
# characters in strings are escaped, "\u0000"), so the encoded body splits at exactly these places.
_SPLICE_MARK = msgspec.Raw(b"\x00")


def with_mask_texts(response: BaseModel, texts: Sequence[list[Any] | None]) -> BaseModel | SplicedJSONResponse:
    """A whole (non-streamed) response whose choice i's `sampling_mask` is texts[i] where given: the engine's
    JSON text of the choice's masks as buffers in order (SamplingMask.json_parts), spliced in as they are instead
    of hundreds of Python ints per token through pydantic. The response without any text is returned as it is;
    with texts, as the body's parts (SplicedJSONResponse): the rest of the body encoded once with a mark where
    each text goes and cut there, the texts' buffers between the pieces, never copied into one body."""
    if all(t is None for t in texts):
        return response
    body = response.model_dump()
    spliced = []
    for choice, text in zip(body["choices"], texts):
        if text is not None:
            choice["sampling_mask"] = _SPLICE_MARK
            spliced.append(text)
    pieces = _json_encoder.encode(body).split(b"\x00")
    assert len(pieces) == len(spliced) + 1
    parts: list[Any] = [pieces[0]]
    for text, piece in zip(spliced, pieces[1:]):
        parts += text
        parts.append(piece)
    return SplicedJSONResponse(parts)


class SplicedJSONResponse(Response):
    """A JSON response sent as its parts in order (with_mask_texts: the encoded body around each choice's masks,
    and the masks' texts as they are); Content-Length is their total.

    NOTE: a non-streamed response with masks is ~870 KB at 256 tokens x ~500 ids; joining the parts into one body
    was one more copy of all of it per response (two with the join of per-token texts before it), on the API
    server's event loop, right when a whole batch of requests finishes together and the next waits to be read."""

    media_type = "application/json"

    def __init__(self, parts: list[Any]) -> None:
        # NOTE: Response.__init__ is not called: it renders one body and counts it.
        self.parts = parts
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-length", str(sum(map(len, parts))).encode()),
                            (b"content-type", b"application/json")]

    @property
    def body(self) -> bytes:  # type: ignore[override]
        """The whole body (tests and tools; the server sends the parts)."""
        return b"".join(self.parts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last = len(self.parts) - 1
        for i, part in enumerate(self.parts):
            await send({"type": "http.response.body", "body": part, "more_body": i < last})


class OpenAIServing:
    # --enable-prompt-tokens-details (vLLM's flag): usage carries prompt_tokens_details.cached_tokens.
    enable_prompt_tokens_details = False

    def __init__(self, engine: AsyncLLM, served_model_names: list[str],
                 preprocess: PreprocessPool | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer: Tokenizer | None = engine.tokenizer
        self.max_model_len = int(engine.model_config.max_model_len or 0)
        self.preprocess = preprocess if preprocess is not None else PreprocessPool()
        # The generation config's sampling defaults (ModelConfig.get_diff_sampling_param), set by build_app.
        self.default_sampling_params: dict[str, Any] = {}
        # --return-tokens-as-token-ids: logprobs name tokens "token_id:{id}" unless a request says otherwise.
        self.return_tokens_as_token_ids = False

    def with_defaults(self, request: Any) -> Any:
        """`request` with the generation config's defaults (vllm/config/generation_config.py) in the sampling fields
        it left unset; max_tokens becomes the smaller of the request's and the default. Unchanged without
        defaults."""
        defaults = self.default_sampling_params
        if not defaults:
            return request
        update = {k: v for k, v in defaults.items() if k != "max_tokens" and getattr(request, k, 0) is None}
        if "max_tokens" in defaults:
            field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None \
                else "max_tokens"
            asked = getattr(request, field)
            update[field] = defaults["max_tokens"] if asked is None else min(asked, defaults["max_tokens"])
        return request.model_copy(update=update)

    def tokens_as_ids(self, requested: bool | None) -> bool:
        """A request's `return_tokens_as_token_ids`, the server's flag where it leaves it unset (vLLM)."""
        return self.return_tokens_as_token_ids if requested is None else requested

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
        """A response's usage; with enable_prompt_tokens_details, the prompt tokens the prefix cache held."""
        usage = UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
        if self.enable_prompt_tokens_details:
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens)
        return usage

    async def encode(self, text: str, add_special_tokens: bool, parameter: str) -> list[int]:
        """`text` as token ids, refused first if its characters cannot fit the context; a long text is tokenized
        in the preprocess pool (request_limits.py)."""
        assert self.tokenizer is not None
        check_prompt_chars(len(text), self.max_model_len, self.tokenizer.max_token_chars, parameter)
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await self.preprocess.run("Tokenizing the prompt", parameter, self.tokenizer.encode, text,
                                         add_special_tokens=add_special_tokens)

    def model_name(self, requested: str | None) -> str:
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names:
            raise NotFoundError(f"The model `{requested}` does not exist.")
        return requested

    def token_str(self, token_id: int, logprob: Logprob | None, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        if self.tokenizer is not None:
            return self.tokenizer.decode([token_id], skip_special_tokens=False)
        return f"token_id:{token_id}"

    def _top(self, entries: dict[int, Logprob], num: int) -> list[tuple[int, Logprob]]:
        """The entries ranked 1..num, by rank (ties in dict order), at most num."""
        # NOTE: filtered before the (stable) sort, which gives the same order; with logprobs=1 one entry is left,
        # not to sort at all. A plain loop: a comprehension's frame costs more than the loop over a few entries.
        top: list[tuple[int, Logprob]] = []
        for item in entries.items():
            rank = item[1].rank
            if rank is not None and rank <= num:
                top.append(item)
        if len(top) > 1:
            top.sort(key=_rank_of)
        return top[:num] if len(top) > num else top

    def completion_logprobs(self, token_ids: Sequence[int], logprobs: Sequence[dict[int, Logprob] | None] | None,
                            num: int, initial_offset: int, as_ids: bool = False) -> dict[str, list] | None:
        """A completion choice's `logprobs` (CompletionLogProbs's fields) as a plain dict, cheap to encode. A None
        position (the first prompt token, echoed) has no logprob and no top logprobs (OpenAI's echo)."""
        if logprobs is None:
            return None
        text_offset: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        top_logprobs: list[dict[str, float] | None] = []
        offset = initial_offset
        token_str = functools.partial(self.token_str, as_ids=as_ids) if as_ids else self.token_str
        # NOTE: `-9999.0 if v < -9999.0 else v` is max(v, -9999.0) (NaN kept) without a builtin call per entry.
        for token_id, entries in zip(token_ids, logprobs):
            if entries is None:
                token = token_str(token_id, None)
                tokens.append(token)
                token_logprobs.append(None)
                top_logprobs.append(None)
                text_offset.append(offset)
                offset += len(token)
                continue
            sampled = entries.get(token_id)
            token = token_str(token_id, sampled)
            tokens.append(token)
            top: dict[str, float] = {}
            for t, lp in self._top(entries, num):
                # the sampled token's entry (the same Logprob) has its string already
                name = token if t == token_id else token_str(t, lp)
                top[name] = -9999.0 if lp.logprob < -9999.0 else lp.logprob
            if sampled is not None:
                v = sampled.logprob
                token_logprobs.append(v)
                top.setdefault(token, -9999.0 if v < -9999.0 else v)
            else:
                token_logprobs.append(None)
            top_logprobs.append(top)
            text_offset.append(offset)
            offset += len(token)
        return {"text_offset": text_offset, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}

    def chat_logprobs(self, token_ids: Sequence[int], logprobs: list[dict[int, Logprob]] | None,
                      num: int, as_ids: bool = False) -> ChatCompletionLogProbs | None:
        if logprobs is None:
            return None
        content: list[ChatCompletionLogProbsContent] = []
        for token_id, entries in zip(token_ids, logprobs):
            sampled = entries.get(token_id)
            token = self.token_str(token_id, sampled, as_ids)
            top = [ChatCompletionLogProb(token=(s := self.token_str(t, lp, as_ids)), logprob=max(lp.logprob, -9999.0),
                                         bytes=list(s.encode("utf-8", errors="replace")))
                   for t, lp in self._top(entries, num)]
            content.append(ChatCompletionLogProbsContent(
                token=token, logprob=max(sampled.logprob, -9999.0) if sampled is not None else -9999.0,
                bytes=list(token.encode("utf-8", errors="replace")), top_logprobs=top))
        return ChatCompletionLogProbs(content=content)


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Logprob] | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` in a response: None for the first prompt token, then per prompt token
    {str(token id): {logprob, rank, decoded_token}}, a -inf logprob as -9999.0 (vLLM's clamp_prompt_logprobs)."""
    if prompt_logprobs is None:
        return None
    return [None if entries is None else
            {str(t): {"logprob": -9999.0 if lp.logprob == float("-inf") else lp.logprob, "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in entries.items()}
            for entries in prompt_logprobs]


def _rank_of(entry: tuple[int, Logprob]) -> int:
    return entry[1].rank  # type: ignore[return-value]  # _top keeps ranked entries only


async def stream_errors(gen: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """Wrap an SSE generator: an error after the stream started becomes an error event, then [DONE]. Closing
    the wrapper closes `gen`."""
    async with contextlib.aclosing(gen):
        try:
            async for chunk in gen:
                yield chunk
        except ValueError as e:
            yield sse(error_body(str(e), 400, "BadRequestError"))
            yield SSE_DONE
        except EngineDeadError as e:
            yield sse(error_body(f"The engine died: {e}", 500, "InternalServerError"))
            yield SSE_DONE
        except (ServerShuttingDownError, EngineSleepingError) as e:
            yield sse(error_body(str(e), 503, "ServiceUnavailableError"))
            yield SSE_DONE


class SSEStream:
    """A streamed response, as a handler returns it: `body`, its SSE events (the handler's chunk generator
    wrapped by stream_errors), and the engine's output streams the chunks are read from.

    `aclose()` ends it however the response ended (done, client gone mid-stream, client gone before the first
    event): it closes the body and every output stream, which aborts each request not finished. The server calls
    it when the response ends; nothing is left to the garbage collector (see OutputStream)."""

    __slots__ = ("body", "streams")

    def __init__(self, chunks: AsyncGenerator[bytes, None], streams: Sequence[OutputStream]) -> None:
        self.body = stream_errors(chunks)
        self.streams = streams

    async def aclose(self) -> None:
        try:
            await self.body.aclose()
        finally:
            self.close_streams()

    def close_streams(self) -> None:
        """Close the output streams only (a body never started needs no closing)."""
        for stream in self.streams:
            stream.close()
