"""AsyncLLM on the bundled model (engine core in its own process): a stream that falls behind gets the steps it
has not taken merged into fewer outputs, with the same tokens, logprobs and masks as a request that was read
to the end in one piece (the reference: a FINAL_ONLY request with the same seed)."""

from __future__ import annotations

import asyncio

from vllm.engine.arg_utils import EngineArgs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

NUM_TOKENS = 24


def test_lagging_stream_gets_merged_outputs() -> None:
    async def run() -> tuple[list, object]:
        config = EngineArgs(max_num_seqs=4, max_model_len=128, return_sampling_mask=True,
                            logprobs_mode="processed_logprobs").create_engine_config()
        engine = AsyncLLM(config, log_stats=False)
        try:
            def params(kind: RequestOutputKind) -> SamplingParams:
                return SamplingParams(temperature=1.0, top_k=20, seed=7, max_tokens=NUM_TOKENS, ignore_eos=True,
                                      logprobs=1, output_kind=kind)

            prompt = {"prompt_token_ids": [5, 17, 42, 9]}
            slow = await engine.add_request("slow", prompt, params(RequestOutputKind.DELTA))
            ref = await engine.add_request("ref", prompt, params(RequestOutputKind.FINAL_ONLY))
            final = [o async for o in engine.stream_outputs("ref", ref)][-1]
            # Both requests ran in the same steps: by now every step of "slow" is in its collector, unread.
            deltas = [o async for o in engine.stream_outputs("slow", slow)]
            return deltas, final
        finally:
            engine.shutdown()

    deltas, final = asyncio.run(run())
    want = final.outputs[0]
    assert len(want.token_ids) == NUM_TOKENS
    assert 1 <= len(deltas) < NUM_TOKENS and deltas[-1].finished
    got_ids = [t for d in deltas for t in d.outputs[0].token_ids]
    assert got_ids == want.token_ids
    got_lp = [lp for d in deltas for lp in d.outputs[0].logprobs]
    # NOTE: the two requests may share some steps and not others (batch shape), so values agree to float noise.
    assert len(got_lp) == len(want.logprobs) == NUM_TOKENS
    for got, ref in zip(got_lp, want.logprobs):
        assert got.keys() == ref.keys()
        for tid in got:
            assert got[tid].rank == ref[tid].rank and abs(got[tid].logprob - ref[tid].logprob) < 1e-4
    got_masks = [m for d in deltas for m in d.outputs[0].sampling_mask.token_ids]
    assert got_masks == want.sampling_mask.token_ids
    assert all(t in m for t, m in zip(got_ids, got_masks))
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_closed_stream_aborts_and_keeps_nothing() -> None:
    """A consumer that stops reading early (a client disconnect) aborts its request, and its collector drops the
    steps it did not take: no request state is left behind, nor a state <-> collector reference cycle."""
    async def run() -> None:
        config = EngineArgs(max_num_seqs=4, max_model_len=128, return_sampling_mask=True,
                            logprobs_mode="processed_logprobs").create_engine_config()
        engine = AsyncLLM(config, log_stats=False)
        try:
            params = SamplingParams(temperature=1.0, top_k=20, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=1,
                                    output_kind=RequestOutputKind.DELTA)
            queue = await engine.add_request("gone", {"prompt_token_ids": [5, 17, 42, 9]}, params)
            gen = engine.stream_outputs("gone", queue)
            first = await gen.__anext__()
            assert not first.finished and len(first.outputs[0].token_ids) >= 1
            await gen.aclose()
            assert queue.empty() and queue._state is None
            assert "gone" not in engine.output_processor.request_states
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_stream_closed_before_its_first_output_or_while_awaited_aborts_in_the_core() -> None:
    """OutputStream.close() aborts its request in the core whether or not it was iterated, and while another task
    waits inside it (whose iteration then ends); a closed stream ends at once. A third request, read to its end,
    is not aborted."""
    async def run() -> None:
        config = EngineArgs(max_num_seqs=4, max_model_len=2048).create_engine_config()
        engine = AsyncLLM(config, log_stats=False)
        sent_to_core: list[str] = []
        abort_in_core = engine.engine_core.abort_requests_async

        async def recording_abort(request_ids: list[str]) -> None:
            sent_to_core.extend(request_ids)
            await abort_in_core(request_ids)

        engine.engine_core.abort_requests_async = recording_abort  # type: ignore[method-assign]
        try:
            # NOTE: far more tokens than the test takes time for, so that neither request finishes on its own.
            params = SamplingParams(temperature=1.0, top_k=20, max_tokens=2000, ignore_eos=True,
                                    output_kind=RequestOutputKind.DELTA)
            prompt = {"prompt_token_ids": [5, 17, 42, 9]}
            unread = engine.stream_outputs("unread", await engine.add_request("unread", prompt, params))
            awaited = engine.stream_outputs("awaited", await engine.add_request("awaited", prompt, params))
            done = engine.stream_outputs("done", await engine.add_request(
                "done", prompt, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)))

            unread.close()
            assert [o async for o in unread] == []

            read: list[object] = []

            async def read_all() -> None:
                async for o in awaited:
                    read.append(o)

            reader = asyncio.create_task(read_all())
            while not read:
                await asyncio.sleep(0.001)
            # The reader took an output and went back into the stream: it waits there (or takes the next one).
            awaited.close()
            await asyncio.wait_for(reader, timeout=10)  # its iteration ends
            assert not read[-1].finished

            outputs = [o async for o in done]
            assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 3
            done.close()
            await asyncio.sleep(0.05)
            assert sorted(sent_to_core) == ["awaited", "unread"]
            for request_id in ("unread", "awaited", "done"):
                assert request_id not in engine.output_processor.request_states
        finally:
            engine.shutdown()

    asyncio.run(run())
