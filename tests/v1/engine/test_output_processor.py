"""OutputProcessor fed with fake EngineCoreOutputs: output kinds, logprobs, sampling masks, stop strings, aborts.

References: logprobs from float64 torch log_softmax over random logits, ranks counted by hand, text from a full
`tokenizer.decode`, masks built directly as sets that contain the sampled token.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from test_tokenizer import build_tokenizer_folder

from vllm.outputs import Logprob, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists

TEXT = "The quick brown fox jumps over the lazy dog. héllo wörld 日本"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return get_tokenizer(build_tokenizer_folder(str(tmp_path_factory.mktemp("tok"))))


@dataclass
class Position:
    token_id: int
    logprob_ids: list[int]  # sampled first, then the top N
    logprobs: list[float]   # float32 values as sent
    rank: int
    mask: list[int]


def make_positions(token_ids: list[int], vocab_size: int, num_logprobs: int, seed: int) -> list[Position]:
    gen = torch.Generator().manual_seed(seed)
    positions = []
    for t in token_ids:
        logits = torch.randn(vocab_size, generator=gen, dtype=torch.float64) * 3
        lp = torch.log_softmax(logits, dim=-1).to(torch.float32)  # what the engine sends: float32
        top = torch.topk(lp, num_logprobs).indices.tolist() if num_logprobs else []
        rank = 1 + int((lp > lp[t]).sum())
        others = torch.randperm(vocab_size, generator=gen)[:int(torch.randint(0, 6, (1,), generator=gen))]
        mask = sorted({t, *others.tolist()})
        ids = [t, *top]
        positions.append(Position(t, ids, [float(lp[i]) for i in ids], rank, mask))
    return positions


def make_output(req_id: str, positions: list[Position], with_logprobs: bool = True, with_masks: bool = True,
                finish_reason: FinishReason | None = None, stop_reason: int | str | None = None) -> EngineCoreOutput:
    logprobs = None
    masks = None
    if with_logprobs and positions:
        logprobs = LogprobsLists(np.array([p.logprob_ids for p in positions], dtype=np.int32),
                                 np.array([p.logprobs for p in positions], dtype=np.float32),
                                 np.array([p.rank for p in positions], dtype=np.int32))
    if with_masks and positions:
        flat = np.array([i for p in positions for i in p.mask], dtype=np.int32)
        if len(positions) == 1:
            masks = SamplingMaskLists(flat, None)
        else:
            offsets = np.cumsum([0] + [len(p.mask) for p in positions]).astype(np.int64)
            masks = SamplingMaskLists(flat, offsets)
    return EngineCoreOutput(request_id=req_id, new_token_ids=[p.token_id for p in positions],
                            new_logprobs=logprobs, new_sampling_mask=masks, finish_reason=finish_reason,
                            stop_reason=stop_reason)


def make_request(req_id: str, prompt_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=req_id, prompt_token_ids=prompt_ids,
                             sampling_params=SamplingParams(**params), eos_token_id=None)


def expected_logprob_dict(tok: Tokenizer | None, p: Position) -> dict[int, Logprob]:
    def text(i: int) -> str | None:
        return None if tok is None else tok.decode([i], skip_special_tokens=False)
    out = {p.token_id: Logprob(p.logprobs[0], p.rank, text(p.token_id))}
    for r, (i, lp) in enumerate(zip(p.logprob_ids[1:], p.logprobs[1:]), start=1):
        out[i] = Logprob(lp, r, text(i))
    return out


def run_steps(proc: OutputProcessor, req_id: str, positions: list[Position], step_sizes: list[int],
              last_finish: FinishReason = FinishReason.LENGTH) -> list[RequestOutput]:
    outputs = []
    i = 0
    for s, n in enumerate(step_sizes):
        chunk = positions[i:i + n]
        i += n
        last = s == len(step_sizes) - 1
        res = proc.process_outputs([make_output(req_id, chunk, finish_reason=last_finish if last else None)])
        assert res.reqs_to_abort == []
        outputs.extend(res.request_outputs)
    return outputs


def test_cumulative_outputs(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    positions = make_positions(ids, tok.vocab_size, num_logprobs=3, seed=0)
    proc = OutputProcessor(tok, log_stats=False)
    prompt = tok.encode("Hi")
    proc.add_request(make_request("a", prompt, logprobs=3, max_tokens=100), prompt="Hi")
    steps = [1, 3, 2] + [1] * (len(ids) - 6)
    outputs = run_steps(proc, "a", positions, steps)
    assert len(outputs) == len(steps)
    n = 0
    for out, step in zip(outputs, steps):
        n += step
        comp = out.outputs[0]
        assert out.request_id == "a" and out.prompt == "Hi" and out.prompt_token_ids == prompt
        assert comp.token_ids == ids[:n]
        assert tok.decode(ids[:n]).startswith(comp.text)
        assert comp.logprobs == [expected_logprob_dict(tok, p) for p in positions[:n]]
        assert comp.cumulative_logprob == pytest.approx(math.fsum(p.logprobs[0] for p in positions[:n]), abs=1e-4)
        assert comp.sampling_mask is not None
        assert comp.sampling_mask.token_ids == [p.mask for p in positions[:n]]
        assert all(t in m for t, m in zip(comp.token_ids, comp.sampling_mask.token_ids))
    final = outputs[-1]
    assert final.finished and final.outputs[0].finish_reason == "length" and final.outputs[0].stop_reason is None
    assert final.outputs[0].text == TEXT
    assert not proc.has_unfinished_requests()


def test_delta_outputs(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    positions = make_positions(ids, tok.vocab_size, num_logprobs=2, seed=1)
    proc = OutputProcessor(tok, log_stats=True)
    proc.add_request(make_request("d", [5], logprobs=2, output_kind=RequestOutputKind.DELTA), prompt=None)
    steps = [2, 1, 4] + [1] * (len(ids) - 7)
    state = proc.request_states["d"]
    outputs = run_steps(proc, "d", positions, steps)
    # Handed out step by step, the state keeps no logprob dicts (nor masks) of earlier steps.
    assert state.logprobs_processor.logprobs == [] and state.masks.num == 0
    i = 0
    text = ""
    for out, step in zip(outputs, steps):
        comp = out.outputs[0]
        assert comp.token_ids == ids[i:i + step]
        assert comp.logprobs == [expected_logprob_dict(tok, p) for p in positions[i:i + step]]
        assert comp.sampling_mask is not None
        assert comp.sampling_mask.token_ids == [p.mask for p in positions[i:i + step]]
        i += step
        # cumulative_logprob stays cumulative in delta mode (as in vLLM).
        assert comp.cumulative_logprob == pytest.approx(math.fsum(p.logprobs[0] for p in positions[:i]), abs=1e-4)
        text += comp.text
    assert text == TEXT
    assert outputs[-1].metrics is not None and outputs[-1].metrics.num_generation_tokens == len(ids)


def test_final_only(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    positions = make_positions(ids, tok.vocab_size, num_logprobs=0, seed=2)
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("f", [5], logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY), prompt=None)
    outputs = run_steps(proc, "f", positions, [1] * len(ids), last_finish=FinishReason.STOP)
    assert len(outputs) == 1
    comp = outputs[0].outputs[0]
    assert comp.finish_reason == "stop"
    assert comp.token_ids == ids
    # With logprobs=0 only the sampled token appears, with its rank.
    assert comp.logprobs == [{p.token_id: Logprob(p.logprobs[0], p.rank, tok.decode([p.token_id],
                                                                                     skip_special_tokens=False))}
                             for p in positions]
    assert comp.sampling_mask is not None and comp.sampling_mask.token_ids == [p.mask for p in positions]
    # The last token was the stop token: its text is not in the output.
    assert comp.text == tok.decode(ids[:-1])


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA])
def test_stop_string_cuts_tokens_logprobs_and_masks(tok: Tokenizer, kind: RequestOutputKind) -> None:
    ids = tok.encode(TEXT)
    positions = make_positions(ids, tok.vocab_size, num_logprobs=1, seed=3)
    k = next(k for k in range(1, len(ids) + 1) if "lazy" in tok.decode(ids[:k]))
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("s", [5], logprobs=1, stop=["lazy"], output_kind=kind), prompt=None)
    proc.add_request(make_request("other", [5]), prompt=None)
    # One big step that runs past the stop string, as a multi-token step would.
    res = proc.process_outputs([make_output("s", positions[:k - 1]), make_output("s", positions[k - 1:k + 3])])
    assert res.reqs_to_abort == ["s"]
    assert [o.finished for o in res.request_outputs] == [False, True]
    first, final = (o.outputs[0] for o in res.request_outputs)
    if kind == RequestOutputKind.DELTA:
        tokens = first.token_ids + final.token_ids
        masks = first.sampling_mask.token_ids + final.sampling_mask.token_ids
        logprobs = first.logprobs + final.logprobs
        text = first.text + final.text
    else:
        tokens, masks, logprobs, text = final.token_ids, final.sampling_mask.token_ids, final.logprobs, final.text
    assert tokens == ids[:k]
    assert masks == [p.mask for p in positions[:k]]
    assert logprobs == [expected_logprob_dict(tok, p) for p in positions[:k]]
    assert final.cumulative_logprob == pytest.approx(math.fsum(p.logprobs[0] for p in positions[:k]), abs=1e-4)
    assert text == TEXT[:TEXT.index("lazy")]
    assert final.finish_reason == "stop" and final.stop_reason == "lazy"
    # The engine core's later outputs for the stopped request are ignored.
    assert proc.process_outputs([make_output("s", positions[k + 3:k + 4])]).request_outputs == []
    assert proc.get_num_unfinished_requests() == 1


def test_stop_token_reason_passes_through(tok: Tokenizer) -> None:
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("t", [5], stop_token_ids=[7]), prompt=None)
    positions = make_positions([9, 7], tok.vocab_size, 0, seed=4)
    res = proc.process_outputs([make_output("t", positions, finish_reason=FinishReason.STOP, stop_reason=7)])
    assert res.reqs_to_abort == []
    comp = res.request_outputs[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == 7 and comp.token_ids == [9, 7]
    assert comp.text == tok.decode([9])


def test_abort_and_queue(tok: Tokenizer) -> None:
    class FakeQueue:
        def __init__(self) -> None:
            self.items: list[RequestOutput] = []

        def put_nowait(self, item: RequestOutput) -> None:
            self.items.append(item)

    q = FakeQueue()
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("q", [5], output_kind=RequestOutputKind.DELTA), prompt="p", queue=q)
    proc.add_request(make_request("plain", [5]), prompt=None)
    with pytest.raises(ValueError, match="already running"):
        proc.add_request(make_request("q", [5]), prompt=None)
    positions = make_positions(tok.encode("héllo"), tok.vocab_size, 0, seed=5)
    res = proc.process_outputs([make_output("q", positions)])
    assert res.request_outputs == [] and len(q.items) == 1
    assert proc.abort_requests(["q", "missing", "plain"]) == ["q", "plain"]
    assert len(q.items) == 2
    final = q.items[-1]
    assert final.finished and final.outputs[0].finish_reason == "abort" and final.outputs[0].token_ids == []
    assert final.outputs[0].sampling_mask is not None and final.outputs[0].sampling_mask.token_ids == []
    assert q.items[0].outputs[0].text + final.outputs[0].text == "héllo"
    assert proc.process_outputs([make_output("q", positions)]).request_outputs == []
    assert not proc.has_unfinished_requests()


def test_engine_abort_output(tok: Tokenizer) -> None:
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("x", [5]), prompt=None)
    res = proc.process_outputs([make_output("x", [], finish_reason=FinishReason.ABORT)])
    assert res.reqs_to_abort == []
    assert res.request_outputs[0].outputs[0].finish_reason == "abort"
    assert res.request_outputs[0].outputs[0].sampling_mask is None


def test_no_tokenizer_no_masks(tok: Tokenizer) -> None:
    proc = OutputProcessor(None, log_stats=False)
    proc.add_request(make_request("n", [5], logprobs=1), prompt=None)
    positions = make_positions([3, 4], tok.vocab_size, 1, seed=6)
    res = proc.process_outputs([make_output("n", positions, with_masks=False, finish_reason=FinishReason.LENGTH)])
    comp = res.request_outputs[0].outputs[0]
    assert comp.text == "" and comp.token_ids == [3, 4] and comp.sampling_mask is None
    assert comp.logprobs == [expected_logprob_dict(None, p) for p in positions]


def test_mask_count_mismatch_is_an_error(tok: Tokenizer) -> None:
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("m", [5]), prompt=None)
    positions = make_positions([3, 4], tok.vocab_size, 0, seed=7)
    bad = make_output("m", positions)
    bad.new_sampling_mask = SamplingMaskLists(np.array(positions[0].mask, dtype=np.int32), None)
    with pytest.raises(RuntimeError, match="2 tokens with 1 sampling masks"):
        proc.process_outputs([bad])


def test_collector_merges_streamed_deltas(tok: Tokenizer) -> None:
    """Outputs the consumer has not taken yet come out as one: the same text, tokens, logprobs and masks as
    the step-by-step outputs concatenated (the reference), and the last step's finish state."""
    import asyncio

    from vllm.v1.engine.output_collector import RequestOutputCollector

    token_ids = tok.encode("The quick brown fox")
    positions = make_positions(token_ids, tok.vocab_size, 1, seed=11)
    steps = [positions[:1], positions[1:3], positions[3:]]

    def run(take_each_step: bool) -> list[RequestOutput]:
        proc = OutputProcessor(tok, log_stats=False)
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        proc.add_request(make_request("m", [5], logprobs=1, output_kind=RequestOutputKind.DELTA), None, collector)
        taken = []
        for i, step in enumerate(steps):
            last = i == len(steps) - 1
            proc.process_outputs([make_output("m", step, finish_reason=FinishReason.LENGTH if last else None)])
            if take_each_step or last:
                taken.append(asyncio.run(collector.get()))
        assert collector.empty()
        return taken

    separate, merged = run(True), run(False)
    assert len(separate) == 3 and len(merged) == 1
    out = merged[0].outputs[0]
    assert merged[0].finished and out.finish_reason == "length"
    assert out.token_ids == token_ids == [t for o in separate for t in o.outputs[0].token_ids]
    assert out.text == "".join(o.outputs[0].text for o in separate) == tok.decode(token_ids)
    assert out.logprobs == [expected_logprob_dict(tok, p) for p in positions]
    assert out.sampling_mask.token_ids == [p.mask for p in positions]
    assert out.cumulative_logprob == separate[-1].outputs[0].cumulative_logprob


def test_collector_cumulative_supersedes_and_error_comes_last() -> None:
    import asyncio

    from vllm.outputs import CompletionOutput
    from vllm.v1.engine.output_collector import RequestOutputCollector

    def output(tokens: list[int], finished: bool) -> RequestOutput:
        return RequestOutput("c", None, [1], None, [CompletionOutput(0, "", tokens, None, None)], finished)

    collector = RequestOutputCollector(RequestOutputKind.CUMULATIVE)
    collector.put_nowait(output([1], False))
    collector.put_nowait(output([1, 2], False))
    error = RuntimeError("engine died")
    collector.put_nowait(error)
    assert asyncio.run(collector.get()).outputs[0].token_ids == [1, 2]
    assert collector.get_nowait() is error

    async def waits_for_put() -> RequestOutput:
        waiter = RequestOutputCollector(RequestOutputKind.DELTA)
        task = asyncio.create_task(waiter.get())
        await asyncio.sleep(0)
        assert not task.done()
        waiter.put_nowait(output([3], True))
        return await task

    assert asyncio.run(waits_for_put()).outputs[0].token_ids == [3]


def test_collector_wakes_its_one_waiter_on_close_and_after_a_cancel() -> None:
    """close() wakes a waiting get() (None); a waiter cancelled leaves the collector usable; a second task
    waiting while one waits is refused."""
    import asyncio

    from vllm.v1.engine.output_collector import RequestOutputCollector

    async def scenario() -> None:
        collector = RequestOutputCollector(RequestOutputKind.DELTA)
        first = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already waiting"):
            await collector.get()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        again = asyncio.create_task(collector.get())
        await asyncio.sleep(0)
        collector.close()
        assert await again is None

    asyncio.run(scenario())


def test_final_only_masks_are_views_of_the_steps(tok: Tokenizer) -> None:
    """A request that returns its masks when it finishes keeps each step's id rows as views of the step's array
    (no copy per row; the one copy is the join when `ids` is read), and its masks are those rows, in order."""
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("f", [5], output_kind=RequestOutputKind.FINAL_ONLY), prompt=None)
    step_ids = np.array([3, 9, 11, 4, 7], dtype=np.int32)  # a step's CSR: rows [3, 9, 11] and [4, 7]
    proc.process_outputs([EngineCoreOutput("f", [9], None, SamplingMaskLists(step_ids[:3], None))])
    assert np.shares_memory(proc.request_states["f"].masks.id_rows[0], step_ids)
    res = proc.process_outputs([EngineCoreOutput("f", [4], None, SamplingMaskLists(np.array([4, 7], np.int32), None),
                                                 finish_reason=FinishReason.LENGTH)])
    comp = res.request_outputs[0].outputs[0]
    assert comp.sampling_mask is not None and comp.sampling_mask.token_ids == [[3, 9, 11], [4, 7]]
    np.testing.assert_array_equal(comp.sampling_mask.ids, [3, 9, 11, 4, 7])
    np.testing.assert_array_equal(comp.sampling_mask.offsets, [0, 3, 5])


def test_delta_stream_holds_only_the_latest_step_masks(tok: Tokenizer) -> None:
    """A streamed (DELTA) request hands each step's masks and JSON texts on in that step's chunk (views of the
    step's message) and keeps none after: earlier steps' messages are not kept alive by it."""
    from vllm.v1.outputs import SamplingMaskText

    ids = tok.encode(TEXT)[:8]
    positions = make_positions(ids, tok.vocab_size, num_logprobs=0, seed=21)
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("d", [5], output_kind=RequestOutputKind.DELTA), prompt=None)
    steps = [1, 3, 1, 3]
    i = 0
    for s, n in enumerate(steps):
        chunk = positions[i:i + n]
        i += n
        out = make_output("d", chunk, with_logprobs=False,
                          finish_reason=FinishReason.LENGTH if s == len(steps) - 1 else None)
        texts = [("[" + ",".join(map(str, p.mask)) + "]").encode() for p in chunk]
        out.new_sampling_mask_text = SamplingMaskText(
            np.frombuffer(b"".join(texts), dtype=np.uint8),
            np.cumsum([0] + [len(t) for t in texts]).astype(np.int64) if n > 1 else None)
        state = proc.request_states["d"]
        res = proc.process_outputs([out])
        comp = res.request_outputs[0].outputs[0]
        # The output's id rows are views of this step's message (until its ids are read), and once handed out the
        # state holds none.
        assert all(np.shares_memory(m, out.new_sampling_mask.token_ids) for m in comp.sampling_mask._id_rows)
        assert state.masks.num == 0 and state.masks.id_rows == [] and state.masks.text.num == 0
        assert comp.token_ids == [p.token_id for p in chunk]
        assert comp.sampling_mask.token_ids == [p.mask for p in chunk]
        assert comp.sampling_mask.json_text() == b"[" + b",".join(texts) + b"]"
    assert proc.get_num_unfinished_requests() == 0


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE,
                                  RequestOutputKind.FINAL_ONLY], ids=["delta", "cumulative", "final"])
def test_masks_sent_as_text_only_or_mixed(tok: Tokenizer, kind: RequestOutputKind) -> None:
    """An API server's engine sends each mask as its JSON text only (no ids); a step may also bring ids only, or
    both. Every output's masks equal the hand-built ones, each kind keeps its tokens' masks whole across the forms,
    and a stop string still cuts the masks with the tokens."""
    from vllm.v1.outputs import SamplingMaskText

    ids = tok.encode(TEXT)[:9]
    positions = make_positions(ids, tok.vocab_size, num_logprobs=0, seed=5)
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("m", [5], output_kind=kind), prompt=None)
    forms = ["text", "both", "ids", "text", "text"]
    steps = [1, 2, 3, 1, 2]
    i = 0
    delivered = []
    for s, (n, form) in enumerate(zip(steps, forms)):
        chunk = positions[i:i + n]
        i += n
        out = make_output("m", chunk, with_logprobs=False, with_masks=form != "text",
                          finish_reason=FinishReason.LENGTH if s == len(steps) - 1 else None)
        if form != "ids":
            texts = [json.dumps(p.mask, separators=(",", ":")).encode() for p in chunk]
            out.new_sampling_mask_text = SamplingMaskText(
                np.frombuffer(b"".join(texts), dtype=np.uint8),
                np.cumsum([0] + [len(t) for t in texts]).astype(np.int64) if n > 1 else None)
        res = proc.process_outputs([out])
        for o in res.request_outputs:
            comp = o.outputs[0]
            delivered.append(comp)
            if kind == RequestOutputKind.DELTA:
                assert comp.sampling_mask.token_ids == [p.mask for p in chunk]
                # The engine's text is spliced as it came (None for an ids-only step).
                assert comp.sampling_mask.json_text() == (
                    None if form == "ids" else json.dumps([p.mask for p in chunk], separators=(",", ":")).encode())
            else:
                assert comp.sampling_mask.token_ids == [p.mask for p in positions[:i]]
                assert len(comp.sampling_mask) == len(comp.token_ids) == i
    assert len(delivered) == (len(steps) if kind != RequestOutputKind.FINAL_ONLY else 1)
    assert proc.get_num_unfinished_requests() == 0


def test_text_only_masks_missing_later_is_an_error(tok: Tokenizer) -> None:
    """Masks that started (as text) and then stop coming is an engine error, as for ids."""
    from vllm.v1.outputs import SamplingMaskText

    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("e", [5], output_kind=RequestOutputKind.DELTA), prompt=None)
    proc.process_outputs([EngineCoreOutput("e", [9], new_sampling_mask_text=SamplingMaskText(
        np.frombuffer(b"[9]", np.uint8), None))])
    with pytest.raises(RuntimeError, match="without their sampling masks"):
        proc.process_outputs([EngineCoreOutput("e", [10])])


def test_collector_builds_pending_steps_when_taken(tok: Tokenizer) -> None:
    """A streamed request's steps wait unbuilt in its collector (put_step): taken after two steps of text-only
    masks, one output has both steps' tokens, logprobs and masks (the engine's texts, spliced as sent); an abort
    while a step is pending comes after it, merged into one output with finish_reason "abort"; an engine error drops
    the unbuilt steps (the failure may have half-updated their state) and comes alone; `close` (the consumer is
    gone) drops them too. Nothing is kept in the request's state once handed out."""
    import asyncio

    from vllm.v1.engine.output_collector import RequestOutputCollector
    from vllm.v1.outputs import SamplingMaskText

    token_ids = tok.encode("The quick brown fox jumps")
    positions = make_positions(token_ids, tok.vocab_size, 1, seed=4)

    def step_output(chunk: list[Position], **kw) -> EngineCoreOutput:
        out = make_output("s", chunk, with_masks=False, **kw)
        texts = [json.dumps(p.mask, separators=(",", ":")).encode() for p in chunk]
        out.new_sampling_mask_text = SamplingMaskText(
            np.frombuffer(b"".join(texts), np.uint8),
            np.cumsum([0] + [len(t) for t in texts]).astype(np.int64) if len(chunk) > 1 else None)
        return out

    proc = OutputProcessor(tok, log_stats=False)
    collector = RequestOutputCollector(RequestOutputKind.DELTA)
    proc.add_request(make_request("s", [5], logprobs=1, output_kind=RequestOutputKind.DELTA), None, collector)
    state = proc.request_states["s"]
    proc.process_outputs([step_output(positions[:2])])
    proc.process_outputs([step_output(positions[2:3])])
    assert not collector.empty() and state.masks.num == 3
    first = collector.get_nowait().outputs[0]
    assert first.token_ids == token_ids[:3] and first.text == tok.decode(token_ids[:3])
    assert first.logprobs == [expected_logprob_dict(tok, p) for p in positions[:3]]
    assert first.sampling_mask.json_text() == json.dumps([p.mask for p in positions[:3]],
                                                         separators=(",", ":")).encode()
    assert collector.empty() and state.masks.num == 0
    proc.process_outputs([step_output(positions[3:4])])
    assert proc.abort_requests(["s"]) == ["s"]
    last = asyncio.run(collector.get())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert last.outputs[0].token_ids == token_ids[3:4] and last.outputs[0].sampling_mask.token_ids == [positions[3].mask]
    assert collector.empty()

    proc.add_request(make_request("s", [5], output_kind=RequestOutputKind.DELTA), None,
                     errored := RequestOutputCollector(RequestOutputKind.DELTA))
    proc.process_outputs([make_output("s", positions[:1], with_logprobs=False)])
    error = RuntimeError("engine died")
    errored.put_nowait(error)
    assert errored.get_nowait() is error

    proc.add_request(make_request("t", [5], output_kind=RequestOutputKind.DELTA), None,
                     gone := RequestOutputCollector(RequestOutputKind.DELTA))
    proc.process_outputs([make_output("t", positions[:1], with_logprobs=False)])
    assert not gone.empty()
    gone.close()
    assert gone.empty() and gone._state is None
