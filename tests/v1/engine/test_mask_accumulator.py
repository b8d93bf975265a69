"""MaskAccumulator: a request's masks stay equal to the plain list of per-token rows across its compactions (every
K id pieces into one array of its own), in every output kind and form, and it keeps at most K - 1 step arrays alive.

Reference: the rows drawn here, kept as a plain list of numpy arrays (and json.dumps of them for the text), never
through the accumulator; retention is read from weak references to each step's array and from
HostStagingSlot.in_use.
"""

from __future__ import annotations

import gc
import json
import pickle
import weakref

import numpy as np
import pytest
import torch

from vllm.outputs import SamplingMask
from vllm.v1.engine.mask_accumulator import MaskAccumulator
from vllm.v1.host_staging import HostStagingSlot
from vllm.v1.outputs import SamplingMaskLists, SamplingMaskText

K = MaskAccumulator.COMPACT_PIECES


def _text(row: np.ndarray) -> bytes:
    return json.dumps(row.tolist(), separators=(",", ":")).encode()


class Steps:
    """Each step's masks as the engine hands them over: the request's rows in a fresh int32 step array between
    other requests' rows (so a view keeps more than the request's ids alive), and/or their JSON texts."""

    def __init__(self, seed: int, max_ids: int = 40) -> None:
        self.rng = np.random.default_rng(seed)
        self.max_ids = max_ids
        self.rows: list[np.ndarray] = []  # the reference: every row drawn, in order (kept ones and cut ones)
        self.step_arrays: list[weakref.ref] = []

    def draw(self, n: int) -> list[np.ndarray]:
        rows = [np.sort(self.rng.choice(151_936, int(self.rng.integers(0, self.max_ids)), replace=False)
                        ).astype(np.int32) for _ in range(n)]
        self.rows.extend(rows)
        return rows

    def step(self, rows: list[np.ndarray], ids: bool = True, text: bool = False
             ) -> tuple[SamplingMaskLists | None, SamplingMaskText | None]:
        lists = texts = None
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        if ids:
            other = self.rng.integers(0, 151_936, 256, dtype=np.int32)
            step_ids = np.concatenate([other, *rows, other])
            self.step_arrays.append(weakref.ref(step_ids))
            mine = step_ids[len(other):len(other) + int(offsets[-1])]
            lists = SamplingMaskLists(mine, None if len(rows) == 1 else offsets)
        if text:
            raw = [_text(r) for r in rows]
            data = np.frombuffer(b"".join(raw), np.uint8)
            texts = SamplingMaskText(data, None if len(rows) == 1 else
                                     np.cumsum([0] + [len(t) for t in raw]).astype(np.int64))
        return lists, texts


def check(mask: SamplingMask, rows: list[np.ndarray], text: bool = False) -> None:
    """`mask` against the reference rows: every form, and pickled."""
    assert len(mask) == len(rows)
    want_offsets = np.cumsum([0] + [len(r) for r in rows])
    np.testing.assert_array_equal(mask.offsets, want_offsets)
    np.testing.assert_array_equal(mask.ids, np.concatenate(rows) if rows else np.zeros(0, np.int32))
    assert mask.ids.dtype == np.int32
    assert mask.token_ids == [r.tolist() for r in rows]
    if text:
        assert mask.json_text() == json.dumps([r.tolist() for r in rows], separators=(",", ":")).encode()
    back = pickle.loads(pickle.dumps(mask, protocol=5))
    assert back.token_ids == [r.tolist() for r in rows]


def accumulators(n: int) -> list[MaskAccumulator]:
    """n accumulators made one after another: with n >= K/2 every first-compaction phase is among them."""
    return [MaskAccumulator(f"r{i}") for i in range(n)]


@pytest.mark.parametrize("num_tokens", [K - 1, K, K + 1, 3 * K + 5])
def test_final_mask_equals_the_rows_across_compactions(num_tokens: int) -> None:
    """One token per step (the fast path), handed over when the request finishes: equal to the reference rows
    whatever the request's first-compaction phase, in ids, offsets, lists and pickled."""
    for i, acc in enumerate(accumulators(K // 2)):
        steps = Steps(seed=i)
        for t in range(num_tokens):
            acc.append(*steps.step(steps.draw(1)), 1, 1, t)
        assert len(acc.id_rows) - acc.num_compacted < K  # type: ignore[arg-type]
        check(acc.take(keep=False), steps.rows)
        assert acc.num == 0 and acc.id_rows == [] and acc.num_compacted == 0


@pytest.mark.parametrize("num_tokens", [K - 1, K + 1, 3 * K + 5])
def test_cumulative_masks_read_their_tokens_after_later_compactions(num_tokens: int) -> None:
    """A cumulative output per step shares the request's pieces, which later compactions replace in place: each
    output, read at the end (and some as they come), still holds exactly its first tokens' masks; so does one
    merged with another (concat) and one read while the request goes on."""
    acc = MaskAccumulator("c")
    steps = Steps(seed=7)
    outputs = []
    for t in range(num_tokens):
        acc.append(*steps.step(steps.draw(1)), 1, 1, t)
        last = t == num_tokens - 1
        outputs.append(acc.take(keep=not last))
        if t in (K // 2, K + 2):
            check(outputs[-1], steps.rows[:t + 1])  # read before the compactions that follow
    assert acc.num_compacted == 0  # the last take handed over
    for t, mask in enumerate(outputs):
        check(mask, steps.rows[:t + 1])
    extra = [np.array([1, 2, 3], np.int32), np.array([], np.int32)]
    merged = outputs[K // 2 + 3].concat(SamplingMask(arrays=extra))
    check(merged, steps.rows[:K // 2 + 4] + extra)


@pytest.mark.parametrize("text", [False, True], ids=["ids", "ids+text"])
def test_delta_and_multi_token_steps_with_stop_cut(text: bool) -> None:
    """Steps of several tokens (some more than K: compacted within one hand-over) with a stop-string cut
    (num_kept < num_new) in between; DELTA (a take every step) and FINAL (one take) agree with the rows kept."""
    sizes = [1, 3, K + 3, 2, 1, 2 * K, 5, 1]
    kept = {1: 2, 4: 0, 6: 3}  # step -> num_kept
    delta, final = MaskAccumulator("d"), MaskAccumulator("f")
    steps = Steps(seed=3)
    want: list[np.ndarray] = []
    num_before = 0
    for s, n in enumerate(sizes):
        rows = steps.draw(n)
        num_kept = kept.get(s, n)
        for acc in (delta, final):
            acc.append(*steps.step(rows, ids=True, text=text), n, num_kept, num_before)
        num_before += num_kept
        check(delta.take(keep=False), rows[:num_kept], text=text)
        want.extend(rows[:num_kept])
    check(final.take(keep=False), want, text=text)


def test_forms_converted_across_compactions() -> None:
    """The ids kept while steps bring text only (parsed) or both, across 3K + 5 tokens; the text kept while steps
    bring ids only (formatted); both kept while both come. Each form equals the rows (and json.dumps of them)."""
    n = 3 * K + 5
    forms = ["ids"] + ["text" if t % 3 == 0 else "both" for t in range(1, n)]
    ids_kept, text_kept, both = MaskAccumulator("i"), MaskAccumulator("t"), MaskAccumulator("b")
    steps = Steps(seed=11)
    for t in range(n):
        rows = steps.draw(1)
        form = forms[t]
        ids_kept.append(*steps.step(rows, ids=form != "text", text=form != "ids"), 1, 1, t)
        text_kept.append(*steps.step(rows, ids=t % 2 == 1, text=t % 2 == 0), 1, 1, t)
        both.append(*steps.step(rows, ids=True, text=True), 1, 1, t)
    mask = ids_kept.take(keep=False)
    assert mask.json_text() is None
    check(mask, steps.rows)
    mask = text_kept.take(keep=False)
    assert mask._id_rows is None
    check(mask, steps.rows, text=True)
    check(both.take(keep=False), steps.rows, text=True)


def test_retention_is_bounded_by_k() -> None:
    """After 3K + 5 one-token steps the accumulator (and a cumulative output sharing its pieces) keeps at most K - 1
    step arrays alive, the latest ones; the earlier arrays are gone. (Before compaction every one stayed alive.)"""
    acc = MaskAccumulator("long")
    steps = Steps(seed=5)
    n = 3 * K + 5
    cumulative = None
    for t in range(n):
        acc.append(*steps.step(steps.draw(1)), 1, 1, t)
        if t == K // 2:
            cumulative = acc.take(keep=True)
    gc.collect()
    alive = [i for i, ref in enumerate(steps.step_arrays) if ref() is not None]
    assert 0 < len(alive) < K
    assert alive == list(range(n - len(alive), n))  # only the steps since the last compaction
    assert cumulative is not None
    check(cumulative, steps.rows[:K // 2 + 1])
    check(acc.take(keep=False), steps.rows)


def test_staging_slot_free_once_compacted() -> None:
    """Rows lent from a HostStagingSlot (views of its pinned memory; here unpinned) keep it in use while the
    accumulator holds them as views; once compacted the slot is free for a later step, and the masks read back are
    the rows the slot held then, not what a later step writes into it."""
    slot = HostStagingSlot(pin=False, lends=True)
    acc = MaskAccumulator("s")
    steps = Steps(seed=9)
    first = steps.draw(1)[0]
    host = slot.copy(torch.from_numpy(np.concatenate([np.arange(50, dtype=np.int32), first])), "ids")
    acc.append(SamplingMaskLists(slot.array("ids", host)[50:], None), None, 1, 1, 0)
    del host
    assert slot.in_use()
    for t in range(1, K):  # the first compaction comes after K/2 to K - 1 pieces
        acc.append(*steps.step(steps.draw(1)), 1, 1, t)
    assert not slot.in_use()
    slot.copy(torch.full((60,), -1, dtype=torch.int32), "ids")  # a later step reuses the slot
    check(acc.take(keep=False), steps.rows)


def test_long_request_next_to_short_ones_through_the_output_processor() -> None:
    """The issue's case, through the OutputProcessor: each step's masks are views of one step array holding every
    running request's rows; short requests come and go next to a long cumulative one. Every output's masks equal
    the reference rows, and once the long one has run 3K + 5 steps at most K - 1 step arrays are alive."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest, FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor

    def request(req_id: str, kind: RequestOutputKind) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=req_id, prompt_token_ids=[5], eos_token_id=None,
                                 sampling_params=SamplingParams(output_kind=kind, detokenize=False))

    proc = OutputProcessor(None, log_stats=False)
    proc.add_request(request("long", RequestOutputKind.CUMULATIVE), prompt=None)
    rng = np.random.default_rng(13)
    rows: dict[str, list[np.ndarray]] = {"long": []}
    short_length: dict[str, int] = {}
    arrays: list[weakref.ref] = []
    outputs = []
    n = 3 * K + 5
    for step in range(n):
        if step % 3 == 0:  # a short request joins (FINAL_ONLY: its masks held until it ends)
            sid = f"short{step}"
            proc.add_request(request(sid, RequestOutputKind.FINAL_ONLY), prompt=None)
            rows[sid], short_length[sid] = [], int(rng.integers(1, 5))
        running = [r for r in rows if r in proc.request_states]
        step_rows = {r: np.sort(rng.choice(1000, int(rng.integers(1, 30)), replace=False)).astype(np.int32)
                     for r in running}
        step_ids = np.concatenate(list(step_rows.values()))
        arrays.append(weakref.ref(step_ids))
        start, outs = 0, []
        for r, row in step_rows.items():
            rows[r].append(row)
            view = step_ids[start:start + len(row)]
            start += len(row)
            done = r == "long" and step == n - 1 or r != "long" and len(rows[r]) == short_length[r]
            outs.append(EngineCoreOutput(r, [int(row[0])], None, SamplingMaskLists(view, None),
                                         finish_reason=FinishReason.LENGTH if done else None))
        del step_ids
        for out in proc.process_outputs(outs).request_outputs:
            mask = out.outputs[0].sampling_mask
            if out.request_id == "long":
                outputs.append(mask)
            else:
                check(mask, rows[out.request_id])
    gc.collect()
    alive = [i for i, ref in enumerate(arrays) if ref() is not None]
    assert len(alive) < K and alive == list(range(n - len(alive), n))
    assert len(outputs) == n
    for t, mask in enumerate(outputs):
        check(mask, rows["long"][:t + 1])
