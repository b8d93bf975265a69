"""The ZMQ engine-core clients against a fake core in a child process: handshake, outputs, aborts, startup
errors and a core that dies."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import numpy as np
import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason, SchedulerStats
from vllm.v1.engine.core_client import AsyncMPClient, EngineDeadError, SyncMPClient, launch_engine_core
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists, SamplingMaskText, StepLogprobs, StepMasks

CRASH_TOKEN = 999_999


class FakeEngineCore:
    """Emits token `len(prompt) + i` at step i with mask [t - 1, t, t + 1]; finishes after max_tokens."""

    num_gpu_blocks = 7

    def __init__(self, vllm_config: object) -> None:
        self.requests: dict[str, tuple[EngineCoreRequest, int]] = {}
        self.aborted: list[str] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.prompt_token_ids[:1] == [CRASH_TOKEN]:
            os._exit(3)
        self.requests[request.request_id] = (request, 0)

    def abort_requests(self, request_ids: list[str]) -> None:
        for req_id in request_ids:
            if self.requests.pop(req_id, None) is not None:
                self.aborted.append(req_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> EngineCoreOutputs:
        outputs = []
        for req_id, (request, n) in list(self.requests.items()):
            token = len(request.prompt_token_ids) + n
            done = n + 1 >= (request.sampling_params.max_tokens or 1)
            mask = SamplingMaskLists(np.array([token - 1, token, token + 1], np.int32), None, None)
            outputs.append(EngineCoreOutput(req_id, [token], None, mask, FinishReason.LENGTH if done else None))
            if done:
                del self.requests[req_id]
            else:
                self.requests[req_id] = (request, n + 1)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=SchedulerStats(num_running_reqs=len(self.requests)))


class GcProbeEngineCore(FakeEngineCore):
    """Answers every request with one step whose tokens are the core process's GC state when it serves:
    gc.get_threshold() and gc.get_freeze_count()."""

    def step(self) -> EngineCoreOutputs:
        import gc

        state = [*gc.get_threshold(), gc.get_freeze_count()]
        outputs = [EngineCoreOutput(req_id, state, None, None, FinishReason.LENGTH) for req_id in self.requests]
        self.requests.clear()
        return EngineCoreOutputs(outputs=outputs)


class FailingEngineCore:
    def __init__(self, vllm_config: object) -> None:
        raise ValueError("model folder /nope has no config.json")


def _request(req_id: str, prompt: list[int], max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(req_id, prompt, SamplingParams(max_tokens=max_tokens), None, 0.0)


def _sync_client(factory: type = FakeEngineCore) -> SyncMPClient:
    return SyncMPClient(None, engine_core_factory=factory, start_method="fork")  # type: ignore[arg-type]


def _collect(client: SyncMPClient, num_finished: int) -> dict[str, list[EngineCoreOutput]]:
    by_req: dict[str, list[EngineCoreOutput]] = {}
    finished = 0
    while finished < num_finished:
        for out in client.get_output(timeout_s=10).outputs:
            by_req.setdefault(out.request_id, []).append(out)
            finished += out.finished
    return by_req


def test_sync_client_round_trip_and_abort() -> None:
    client = _sync_client()
    try:
        assert client.ready_info["num_gpu_blocks"] == 7
        client.add_request(_request("a", [1, 2, 3], 4))
        client.add_request(_request("b", [1], 2))
        by_req = _collect(client, 2)
        assert [o.new_token_ids[0] for o in by_req["a"]] == [3, 4, 5, 6]
        assert [o.new_token_ids[0] for o in by_req["b"]] == [1, 2]
        for outs in by_req.values():
            for o in outs:
                assert isinstance(o.new_sampling_mask, SamplingMaskLists)
                t = o.new_token_ids[0]
                assert o.new_sampling_mask.to_nested_list() == [[t - 1, t, t + 1]]
        assert by_req["a"][-1].finish_reason is FinishReason.LENGTH

        # A long request aborted mid-way stops producing outputs; a later request still runs.
        client.add_request(_request("long", [1], 10_000))
        assert client.get_output(timeout_s=10).outputs[0].request_id == "long"
        client.abort_requests(["long"])
        client.add_request(_request("after", [1, 1], 1))
        seen_after = False
        while not seen_after:
            outs = client.get_output(timeout_s=10).outputs
            seen_after = any(o.request_id == "after" for o in outs)
        assert all(o.request_id != "long" for o in outs)
    finally:
        client.shutdown()
    assert not client.proc.is_alive()


def test_startup_error_is_raised_in_parent() -> None:
    with pytest.raises(RuntimeError, match="no config.json"):
        _sync_client(FailingEngineCore)


def test_dead_core_raises_engine_dead_error() -> None:
    client = _sync_client()
    try:
        client.add_request(_request("boom", [CRASH_TOKEN], 3))
        with pytest.raises(EngineDeadError):
            client.get_output(timeout_s=10)
        assert client.is_dead
        with pytest.raises(EngineDeadError):
            client.add_request(_request("x", [1], 1))
    finally:
        client.shutdown()


def test_async_client_streams_outputs() -> None:
    async def run() -> list[int]:
        client = AsyncMPClient(None, engine_core_factory=FakeEngineCore, start_method="fork")  # type: ignore[arg-type]
        try:
            await client.add_request_async(_request("a", [5, 5], 3))
            tokens: list[int] = []
            while len(tokens) < 3:
                outputs = await asyncio.wait_for(client.get_output_async(), 10)
                tokens += [t for o in outputs.outputs for t in o.new_token_ids]
            return tokens
        finally:
            client.shutdown()

    assert asyncio.run(run()) == [2, 3, 4]


def test_async_client_get_output_nowait_reads_only_what_is_queued() -> None:
    """get_output_nowait never waits: None before the core has sent anything, then the queued steps in order."""
    import time

    async def run() -> tuple[object, list[int]]:
        client = AsyncMPClient(None, engine_core_factory=FakeEngineCore, start_method="fork")  # type: ignore[arg-type]
        try:
            first = client.get_output_nowait()
            await client.add_request_async(_request("a", [5, 5], 4))
            time.sleep(1.0)  # the core runs all four steps; their outputs wait in the socket
            tokens: list[int] = []
            while (outputs := client.get_output_nowait()) is not None:
                tokens += [t for o in outputs.outputs for t in o.new_token_ids]
            return first, tokens
        finally:
            client.shutdown()

    first, tokens = asyncio.run(run())
    assert first is None
    assert tokens == [2, 3, 4, 5]


def _next_output(client: SyncMPClient, req_id: str) -> EngineCoreOutput:
    """The next output of `req_id`; the messages before it must be other requests' or stats only."""
    while True:
        outputs = client.get_output(timeout_s=10)
        assert outputs.scheduler_stats is not None  # stats reach every client
        for out in outputs.outputs:
            if out.request_id == req_id:
                return out


def test_shared_core_routes_outputs_to_their_client_and_refuses_a_duplicate_id() -> None:
    """launch_engine_core for two clients (as --api-server-count 2): each client gets READY and only its own
    requests' outputs; an id already running for the other client is refused with an ABORT-finished output to
    the sender alone, and the running request goes on."""
    proc, handles, tmp_dir = launch_engine_core(None, 2, FakeEngineCore, start_method="fork")  # type: ignore[arg-type]
    clients = [SyncMPClient(None, handle=h) for h in handles]  # type: ignore[arg-type]
    try:
        assert [c.ready_info["num_gpu_blocks"] for c in clients] == [7, 7]
        clients[0].add_request(_request("a", [1, 2, 3], 3))
        clients[1].add_request(_request("b", [1], 4))
        clients[1].add_request(_request("c", [1, 1], 2))
        by0, by1 = _collect(clients[0], 1), _collect(clients[1], 2)
        assert set(by0) == {"a"} and set(by1) == {"b", "c"}
        assert [o.new_token_ids[0] for o in by0["a"]] == [3, 4, 5]
        assert [o.new_token_ids[0] for o in by1["b"]] == [1, 2, 3, 4]
        assert [o.new_token_ids[0] for o in by1["c"]] == [2, 3]

        clients[0].add_request(_request("dup", [1], 10_000))
        assert _next_output(clients[0], "dup").new_token_ids == [1]
        clients[1].add_request(_request("dup", [1, 1, 1], 5))
        refused = _collect(clients[1], 1)["dup"]
        assert len(refused) == 1 and refused[0].finish_reason is FinishReason.ABORT
        assert refused[0].new_token_ids == []
        # The first "dup" still runs for client 0 (its step count goes on); client 1 can still add requests.
        clients[1].add_request(_request("d", [1], 1))
        assert [o.new_token_ids for o in _collect(clients[1], 1)["d"]] == [[1]]
        later = _next_output(clients[0], "dup")
        assert not later.finished and later.new_token_ids[0] > 1
        # Client 1 aborting the id it was refused (its caller went away) leaves client 0's request running.
        clients[1].abort_requests(["dup"])
        clients[1].add_request(_request("e", [1], 1))
        assert [o.new_token_ids for o in _collect(clients[1], 1)["e"]] == [[1]]
        still = _next_output(clients[0], "dup")
        assert not still.finished and still.new_token_ids[0] > later.new_token_ids[0]
        clients[0].abort_requests(["dup"])

        # A core that dies is seen by every client, even before its parent reaped it (a zombie).
        os.kill(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not all(c.is_dead for c in clients) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(c.is_dead for c in clients)
        proc.join(5)
    finally:
        for c in clients:
            c.shutdown()
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        shutil.rmtree(tmp_dir, ignore_errors=True)


class StepMaskEngineCore(FakeEngineCore):
    """FakeEngineCore whose masks (and their JSON text) and logprobs stay in step arrays (StepMasks,
    StepLogprobs), as the scheduler's do; the step's rows are laid out in reverse output order, so every client's
    rows need a gather. Token t's logprobs row: ids [t, t + 7], logprobs [-t / 1000, -1], rank t % 5 + 1."""

    WITH_TEXT = True

    def step(self) -> EngineCoreOutputs:
        outs = super().step()
        rows = [o.new_sampling_mask.token_ids for o in outs.outputs][::-1]
        for o in outs.outputs:
            o.new_sampling_mask = None
        texts = [np.frombuffer(json.dumps(r.tolist(), separators=(",", ":")).encode(), np.uint8) for r in rows]
        mask_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        text_offsets = np.cumsum([0] + [len(t) for t in texts]).astype(np.int64)
        n = len(rows)
        outs.step_masks = StepMasks(
            SamplingMaskLists(np.concatenate(rows) if n else np.zeros(0, np.int32), mask_offsets),
            SamplingMaskText(np.concatenate(texts) if n else np.zeros(0, np.uint8), text_offsets)
            if self.WITH_TEXT else None,
            np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64)[::-1].copy(), np.ones(n, dtype=np.int64))
        tokens = np.array([o.new_token_ids[0] for o in outs.outputs][::-1], dtype=np.int64).reshape(n)
        lists = LogprobsLists(np.stack([tokens, tokens + 7], axis=1).astype(np.int32),
                              np.stack([-tokens / 1000, -np.ones(n)], axis=1).astype(np.float32),
                              (tokens % 5 + 1).astype(np.int32))
        outs.step_logprobs = StepLogprobs(lists, np.arange(n, dtype=np.int64),
                                          np.arange(n, dtype=np.int64)[::-1].copy(),
                                          np.ones(n, dtype=np.int64))
        return outs


class StepMaskIdsEngineCore(StepMaskEngineCore):
    """The same without the masks' JSON text (an engine whose clients asked for no text): the ids travel."""

    WITH_TEXT = False


@pytest.mark.parametrize("core", [StepMaskEngineCore, StepMaskIdsEngineCore], ids=["text", "ids"])
def test_shared_core_splits_step_rows_per_client(core: type) -> None:
    """Each client gets exactly its requests' rows; a mask with its JSON text travels as the text only."""
    proc, handles, tmp_dir = launch_engine_core(None, 2, core, start_method="fork")  # type: ignore[arg-type]
    clients = [SyncMPClient(None, handle=h) for h in handles]  # type: ignore[arg-type]
    try:
        for i in range(6):
            clients[i % 2].add_request(_request(f"r{i}", [1] * (i + 1), 3))
        by_client = [_collect(clients[0], 3), _collect(clients[1], 3)]
        assert set(by_client[0]) == {"r0", "r2", "r4"} and set(by_client[1]) == {"r1", "r3", "r5"}
        for by_req in by_client:
            for outs in by_req.values():
                for o in outs:
                    t = o.new_token_ids[0]
                    if core.WITH_TEXT:
                        assert o.new_sampling_mask is None
                        assert bytes(o.new_sampling_mask_text.text) == f"[{t - 1},{t},{t + 1}]".encode()
                    else:
                        assert o.new_sampling_mask.to_nested_list() == [[t - 1, t, t + 1]]
                        assert o.new_sampling_mask_text is None
                    ids, values, ranks = o.new_logprobs[:3]
                    assert ids == [[t, t + 7]] and ranks == [t % 5 + 1]
                    assert values == [[pytest.approx(-t / 1000), -1.0]]
    finally:
        for c in clients:
            c.shutdown()
        proc.terminate()
        proc.join(5)
        shutil.rmtree(tmp_dir, ignore_errors=True)


def test_step_mask_texts_packed_by_client_are_one_span_each() -> None:
    """StepMasks whose texts the device packed by API server (SamplingMaskText.rank): each client's share
    (`select`, as send_outputs takes it) gathers exactly its own rows' bytes, each row's text intact; in-process
    `materialize` cuts the same texts."""
    rows = [[1, 2], [30], [400, 401, 402], [5], [66, 67], [7]]
    client = np.array([1, 0, 1, 2, 0, 1])
    texts = [json.dumps(r, separators=(",", ":")).encode() for r in rows]
    order = np.argsort(client, kind="stable")
    rank = np.empty(len(rows), dtype=np.int64)
    rank[order] = np.arange(len(rows))
    packed = b"".join(texts[r] for r in order)
    offsets = np.cumsum([0] + [len(texts[r]) for r in order]).astype(np.int64)
    flat = np.array([i for r in rows for i in r], dtype=np.int32)
    mask_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    n = len(rows)
    step = StepMasks(SamplingMaskLists(flat, mask_offsets),
                     SamplingMaskText(np.frombuffer(packed, np.uint8), offsets, None, rank),
                     np.arange(n, dtype=np.int64), np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64))
    for c in range(3):
        mine = np.flatnonzero(client == c)
        starts, sizes, data = step.select(mine, np.arange(len(mine), dtype=np.int64)).gather(text=True)
        assert len(data) == sum(len(texts[r]) for r in mine)  # its own bytes, nothing of the other clients
        for r, start, size in zip(mine, starts.tolist(), sizes.tolist()):
            assert data[start:start + size].tobytes() == texts[r]
    outs = [EngineCoreOutput(request_id=f"r{i}", new_token_ids=[i]) for i in range(n)]
    step.materialize(outs)
    assert [o.new_sampling_mask_text.text.tobytes() for o in outs] == texts
    assert [o.new_sampling_mask.token_ids.tolist() for o in outs] == rows


def test_engine_core_serves_with_frozen_heap_and_serving_gc_thresholds() -> None:
    """The core process freezes its start-up heap and collects with the serving thresholds (Python's defaults,
    (700, 10, 10), ran a full collection every ~0.5 s at ~1000 rows, each longer than a decode step)."""
    from vllm.v1.serving_gc import SERVING_GC_THRESHOLDS

    client = _sync_client(GcProbeEngineCore)
    try:
        client.add_request(_request("gc", [1], 1))
        (out,) = _collect(client, 1)["gc"]
    finally:
        client.shutdown()
    assert SERVING_GC_THRESHOLDS != (700, 10, 10)
    assert tuple(out.new_token_ids[:3]) == SERVING_GC_THRESHOLDS
    assert out.new_token_ids[3] > 1000  # the imports alone are tens of thousands of objects
