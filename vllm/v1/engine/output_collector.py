"""RequestOutputCollector: one request's output queue in AsyncLLM, merging what its consumer has not taken yet
(`merge_delta_outputs`, `merge_weight_spans`); `OutputQueue` is what the output processor puts into."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine import FinishReason

if TYPE_CHECKING:
    from vllm.v1.engine.output_processor import RequestState


class OutputQueue(Protocol):
    """What AsyncLLM hands in per request (an asyncio.Queue or a collector with the same method)."""

    def put_nowait(self, item: Any) -> None: ...


class RequestOutputCollector:
    """A request's output queue for AsyncLLM that never grows: outputs the consumer has not taken yet are merged.

    When the HTTP side lags behind the engine (many streams, large chunks), a stream then sends one chunk per
    round of the event loop instead of one per engine step, so the frontend's per-chunk cost stops scaling with
    the step rate. DELTA outputs are concatenated (text, token ids, logprobs and sampling masks, per choice
    index); CUMULATIVE and FINAL_ONLY outputs supersede the pending one. An exception is delivered after the
    pending output.

    A streamed (DELTA) request of its own (n == 1) hands its steps over with `put_step` instead: the collector
    only notes the step's tokens and finish, and the RequestOutput of every step not taken yet is built once,
    when the consumer takes it (RequestState holds their logprobs, masks and text until then). A server that
    falls behind then does no per-step output building and merging at all for its streams, the work that
    otherwise grows with the number of steps each chunk merges. An error drops such unbuilt steps.

    One consumer at a time waits on it (`get`, or `wait` as OutputStream does).
    """

    __slots__ = ("output_kind", "_output", "_error", "_waiter", "_state", "_step_ids", "_finish", "_closed")

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        # The waiting consumer's future, done by the next put or close. NOTE: a bare future rather than an
        # asyncio.Event: a streamed token's put and wake-up are then no Python-level Event.set / Event.wait calls.
        self._waiter: asyncio.Future | None = None
        # put_step: the request whose steps are pending, their kept token ids, and the last (finish, stop) reason.
        self._state: RequestState | None = None
        self._step_ids: list[int] = []
        self._finish: tuple[FinishReason | None, int | str | None] = (None, None)
        self._closed = False

    def put_step(self, state: RequestState, token_ids: list[int], finish_reason: FinishReason | None,
                 stop_reason: int | str | None) -> None:
        """One step of `state` (a DELTA request without a parent), built into a RequestOutput when taken."""
        assert self._output is None and (self._state is None or self._state is state)
        if self._state is None:
            self._state = state
            self._step_ids = list(token_ids)
        else:
            self._step_ids.extend(token_ids)
        self._finish = (finish_reason, stop_reason)
        self._wake()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
            # NOTE: steps not built yet are dropped: the failure may have left their request's state half-updated
            # by a step it did not finish (the stream ends with the error either way).
            self._state, self._step_ids = None, []
        elif self._output is None or self.output_kind != RequestOutputKind.DELTA:
            self._output = item
        else:
            merge_delta_outputs(self._output, item)
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # cancelled with its consumer
                waiter.set_result(None)

    def empty(self) -> bool:
        return self._output is None and self._state is None and self._error is None

    def close(self) -> None:
        """The consumer is gone: drop what it did not take (a pending request state refers back to this
        collector, a cycle only the cyclic GC would free, with the step frames its masks are views of). A `get()`
        waiting, or any later, returns None."""
        self._output, self._state, self._step_ids = None, None, []
        self._closed = True
        self._wake()

    def get_nowait(self) -> RequestOutput | BaseException:
        """The pending output (or, once none is pending, the error); raises asyncio.QueueEmpty if neither."""
        if self._state is not None:
            state, token_ids, (finish_reason, stop_reason) = self._state, self._step_ids, self._finish
            self._state, self._step_ids = None, []
            output = state.make_request_output(token_ids, finish_reason, stop_reason)
            assert output is not None  # DELTA: every step has an output
        elif self._output is not None:
            output, self._output = self._output, None
        elif self._error is not None:
            output = self._error
        else:
            raise asyncio.QueueEmpty
        return output

    @property
    def closed(self) -> bool:
        return self._closed

    def wait(self) -> asyncio.Future:
        """A future done at the next put or close (await it while `empty()` and not `closed`). One waiter at a
        time: a second one while the first still waits is refused."""
        if self._waiter is not None and not self._waiter.done():
            raise RuntimeError("RequestOutputCollector: another task is already waiting for this request's output.")
        self._waiter = waiter = asyncio.get_running_loop().create_future()
        return waiter

    async def get(self) -> RequestOutput | BaseException | None:
        while self.empty():
            if self._closed:
                return None
            await self.wait()
        return self.get_nowait()


def merge_delta_outputs(into: RequestOutput, new: RequestOutput) -> None:
    """Append DELTA output `new` to the not-yet-delivered DELTA output `into` (same request), in place."""
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
            continue
        old.text += c.text
        old.token_ids = old.token_ids + c.token_ids
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + c.logprobs
        if c.sampling_mask is not None:
            old.sampling_mask = (c.sampling_mask if old.sampling_mask is None
                                 else old.sampling_mask.concat(c.sampling_mask))
        if c.weight_versions:
            old.weight_versions = merge_weight_spans(old.weight_versions, c.weight_versions)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason = c.finish_reason
        old.stop_reason = c.stop_reason
    into.outputs.sort(key=lambda c: c.index)
    if into.prompt_logprobs is None:
        into.prompt_logprobs = new.prompt_logprobs
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics


def merge_weight_spans(first: list[list[Any]] | None, then: list[list[Any]]) -> list[list[Any]]:
    """The weight-version spans of two consecutive deltas as one list (a span running across them joined)."""
    if not first:
        return then
    if first[-1][0] == then[0][0] and first[-1][2] == then[0][1]:
        return [*first[:-1], [first[-1][0], first[-1][1], then[0][2]], *then[1:]]
    return first + then
