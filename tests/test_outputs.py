"""SamplingMask: the list form (upstream's token_ids), the compact form (ids + counts) and the engine's JSON text
agree (references: json.dumps, lists written by hand)."""

import json

import numpy as np
import pytest

from vllm.outputs import CompletionOutput, RequestOutput, SamplingMask, ids_from_json_text, json_text_of


def test_sampling_mask_forms_agree() -> None:
    arrays = [np.array([3, 7, 9], dtype=np.int32), np.array([1], dtype=np.int32), np.array([0, 2], dtype=np.int32)]
    from_arrays = SamplingMask(arrays=arrays)
    from_lists = SamplingMask(token_ids=[[3, 7, 9], [1], [0, 2]])
    assert from_arrays.token_ids == [[3, 7, 9], [1], [0, 2]]
    assert from_arrays == from_lists and len(from_arrays) == len(from_lists) == 3
    for mask in (from_arrays, from_lists):
        np.testing.assert_array_equal(mask.counts, [3, 1, 2])
        np.testing.assert_array_equal(mask.ids, [3, 7, 9, 1, 0, 2])
        assert mask.ids.dtype == np.int32
    assert SamplingMask().token_ids == [] and len(SamplingMask(arrays=[]).ids) == 0
    with pytest.raises(ValueError):
        SamplingMask(token_ids=[[1]], arrays=arrays)


def test_sampling_mask_from_texts_only() -> None:
    """An API server's mask may come as the engine's JSON text only: the ids are parsed from it on access, and the
    text is what json_text splices; concat keeps whichever forms both sides have."""
    rows = [[3, 7, 151935], [], [0, 2]]
    texts = [np.frombuffer(json.dumps(r, separators=(",", ":")).encode(), np.uint8) for r in rows]
    mask = SamplingMask(texts=texts)
    assert len(mask) == 3 and mask.json_text() == json.dumps(rows, separators=(",", ":")).encode()
    assert mask.token_ids == rows and mask == SamplingMask(token_ids=rows)
    np.testing.assert_array_equal(mask.counts, [3, 0, 2])
    np.testing.assert_array_equal(mask.ids, [3, 7, 151935, 0, 2])
    arrays = [np.array(r, dtype=np.int32) for r in rows]
    both = SamplingMask(arrays=arrays, texts=texts)
    # texts + texts keep the text; texts + arrays only fall back to ids (parsed), in order.
    assert SamplingMask(texts=texts).concat(both).json_text() == json.dumps(rows + rows, separators=(",", ":")).encode()
    mixed = SamplingMask(texts=texts[:1]).concat(SamplingMask(arrays=arrays[1:]))
    assert mixed.json_text() is None and mixed.token_ids == rows
    assert SamplingMask(token_ids=[[1]]).concat(SamplingMask(texts=texts[:1])).token_ids == [[1], rows[0]]
    with pytest.raises(ValueError):
        SamplingMask(arrays=arrays[:2], texts=texts)
    with pytest.raises(ValueError):
        SamplingMask(token_ids=rows, texts=texts)


def test_mask_text_round_trip() -> None:
    """json_text_of formats ids as json.dumps does (no spaces); ids_from_json_text reads them back."""
    rng = np.random.default_rng(0)
    for n in (0, 1, 5, 512):
        ids = np.sort(rng.choice(152_000, n, replace=False)).astype(np.int32)
        text = json_text_of(ids)
        assert text == json.dumps(ids.tolist(), separators=(",", ":")).encode()
        np.testing.assert_array_equal(ids_from_json_text(np.frombuffer(text, np.uint8)), ids)
    with pytest.raises(Exception):
        ids_from_json_text(b"[1,2")


def test_request_output_accepts_and_ignores_unknown_keywords(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's RequestOutput(...) arguments this engine has no use for (lora_request, encoder_prompt, ...) and unknown
    ones are accepted and ignored, as vLLM does; the fields are those given, positionally or by name."""
    completion = CompletionOutput(index=0, text="a", token_ids=[5], cumulative_logprob=None, logprobs=None)
    by_name = RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2], prompt_logprobs=None,
                            outputs=[completion], finished=True, lora_request=None, encoder_prompt=None,
                            encoder_prompt_token_ids=None, multi_modal_placeholders={}, kv_transfer_params=None,
                            num_cached_tokens=3, metrics=None)
    positional = RequestOutput("r", "p", [1, 2], None, [completion], True, 3, None)
    assert by_name == positional
    assert (by_name.request_id, by_name.prompt_token_ids, by_name.finished, by_name.num_cached_tokens) == (
        "r", [1, 2], True, 3)
    assert RequestOutput("r", None, None, None, [], False).metrics is None
    assert not caplog.records  # vLLM's own arguments: no warning
    RequestOutput("r", None, None, None, [], False, some_future_field=1)
    assert "ignoring unknown argument(s) some_future_field" in caplog.text
    with pytest.raises(TypeError):  # a missing required field is still the caller's error
        RequestOutput(request_id="r")  # type: ignore[call-arg]


def test_sampling_mask_flat_form_matches_the_lists() -> None:
    """from_flat(ids, offsets): token t's support is ids[offsets[t]:offsets[t + 1]]; its lists, ids, offsets and
    counts agree with the same masks given as lists (hand-written), and offsets that are not a CSR are refused."""
    rows = [[3, 7, 9], [], [1], [0, 2, 151935]]
    offsets = np.array([0, 3, 3, 4, 7])
    mask = SamplingMask.from_flat(np.array([3, 7, 9, 1, 0, 2, 151935], dtype=np.int64), offsets)
    assert mask.token_ids == rows and mask == SamplingMask(token_ids=rows) and len(mask) == 4
    assert mask.ids.dtype == np.int32 and mask.offsets.dtype == np.int64
    np.testing.assert_array_equal(mask.offsets, offsets)
    np.testing.assert_array_equal(mask.counts, [3, 0, 1, 3])
    np.testing.assert_array_equal(SamplingMask(token_ids=rows).offsets, offsets)
    assert mask.json_text() is None  # no engine text: the lists go through the encoder
    for bad in ([1, 3, 3, 4, 7], [0, 3, 2, 4, 7], [0, 3, 3, 4, 6], []):
        with pytest.raises(ValueError):
            SamplingMask.from_flat(np.arange(7), np.array(bad))


def test_mask_text_blocks_across_block_boundaries() -> None:
    """MaskTextBlocks writes rows into blocks that double from the first row's size: the parts of 300 rows of
    random sizes (many blocks) are json.dumps of the rows, an owned hand-over closes its last block in place (no
    copy), and a reader of the first k tokens (a cumulative output) sees exactly those, also after more appends
    and after the owner closed the text."""
    from vllm.outputs import MaskTextBlocks, _text_parts

    rng = np.random.default_rng(3)
    rows = [sorted(rng.choice(151_936, int(rng.integers(0, 60)), replace=False).tolist()) for _ in range(300)]
    blocks = MaskTextBlocks()
    snapshots = []
    for k, row in enumerate(rows):
        blocks.append(np.frombuffer(json.dumps(row, separators=(",", ":")).encode(), np.uint8))
        if k in (0, 7, 150):
            snapshots.append((k + 1, blocks.snapshot()))
    assert len(blocks.blocks) > 3 and max(map(len, blocks.blocks)) <= MaskTextBlocks.BLOCK_BYTES
    whole = blocks.snapshot()
    owned = _text_parts(*whole, owned=True)
    assert owned[0] is blocks.blocks[0] and len(owned) == len(blocks.blocks)
    assert b"".join(owned) == json.dumps(rows, separators=(",", ":")).encode()
    for num, snap in snapshots:
        assert json.loads(b"".join(_text_parts(*snap, owned=False))) == rows[:num]
    assert _text_parts([], 0, 0, 0, owned=True) == [b"[]"]


def test_cumulative_masks_share_and_stay_whole() -> None:
    """A cumulative output's mask reads its first tokens of its request's buffers while the request goes on; the
    final (owned) hand-over of the same buffers does not change what the earlier one reads."""
    from vllm.v1.engine.mask_accumulator import MaskAccumulator
    from vllm.v1.outputs import SamplingMaskLists, SamplingMaskText

    rows = [[1, 5], [2], [0, 3, 4]]
    acc = MaskAccumulator("r")
    seen = []
    for k, row in enumerate(rows):
        text = np.frombuffer(json.dumps(row, separators=(",", ":")).encode(), np.uint8)
        acc.append(SamplingMaskLists(np.array(row, np.int32), None), SamplingMaskText(text, None), 1, 1, k)
        seen.append(acc.take(keep=k < len(rows) - 1))
    assert acc.num == 0  # the last take handed the buffers over
    for k, mask in enumerate(seen):
        assert mask.token_ids == rows[:k + 1]
        assert json.loads(mask.json_text()) == rows[:k + 1]
        np.testing.assert_array_equal(mask.offsets, np.cumsum([0] + [len(r) for r in rows[:k + 1]]))
    assert seen[0].json_text() == b"[[1,5]]" and seen[-1].json_text() == b"[[1,5],[2],[0,3,4]]"


def test_sampling_mask_pickles_with_its_masks() -> None:
    """A RequestOutput crosses processes pickled (Ray actors return rollouts so): a mask handed over by the output
    processor (id views of a step's array, text blocks) comes back with the same masks, and carries only its own
    rows' ids, not the whole step array its views came from."""
    import pickle

    from vllm.v1.engine.mask_accumulator import MaskAccumulator
    from vllm.v1.outputs import SamplingMaskLists, SamplingMaskText

    step = np.arange(100_000, dtype=np.int32)  # a step's array, much larger than the request's rows
    rows = [[1, 5], [7]]
    acc = MaskAccumulator("r")
    for k, row in enumerate(rows):
        view = step[row[0]:row[0] + 1] if len(row) == 1 else step[[1, 5]]
        text = np.frombuffer(json.dumps(row, separators=(",", ":")).encode(), np.uint8)
        acc.append(SamplingMaskLists(view, None), SamplingMaskText(text, None), 1, 1, k)
    mask = acc.take(keep=False)
    data = pickle.dumps(mask)
    assert len(data) < 4_000  # not the step's 400 KB
    back = pickle.loads(data)
    assert back.token_ids == rows and json.loads(back.json_text()) == rows
    np.testing.assert_array_equal(back.offsets, [0, 2, 3])


@pytest.mark.parametrize("form", ["arrays", "texts", "both", "lists", "flat", "empty"])
def test_sampling_mask_pickles_flat(form: str) -> None:
    """Pickled, a mask is a few flat buffers whatever its token count (protocol 5, as Ray pickles: not a buffer per
    token), and comes back with the same masks, ids, offsets and JSON text (json.dumps of the lists: the
    reference)."""
    import pickle

    rng = np.random.default_rng(0)
    rows = [] if form == "empty" else [sorted(rng.choice(1000, size=int(rng.integers(1, 9)), replace=False).tolist())
                                       for _ in range(256)]
    arrays = [np.array(r, dtype=np.int32) for r in rows]
    texts = [json.dumps(r, separators=(",", ":")).encode() for r in rows]
    mask = {"arrays": lambda: SamplingMask(arrays=arrays), "texts": lambda: SamplingMask(texts=texts),
            "both": lambda: SamplingMask(arrays=arrays, texts=texts), "lists": lambda: SamplingMask(rows),
            "flat": lambda: SamplingMask.from_flat(np.concatenate(arrays) if rows else np.zeros(0, np.int32),
                                                   np.cumsum([0] + [len(r) for r in rows])),
            "empty": lambda: SamplingMask(arrays=[])}[form]()
    buffers: list = []
    data = pickle.dumps(mask, protocol=5, buffer_callback=buffers.append)
    assert len(buffers) <= 2
    back = pickle.loads(data, buffers=buffers)
    assert back.token_ids == rows and len(back) == len(rows)
    np.testing.assert_array_equal(back.offsets, np.cumsum([0] + [len(r) for r in rows]))
    np.testing.assert_array_equal(back.ids, np.array([i for r in rows for i in r], dtype=np.int32))
    if form in ("texts", "both"):
        assert back.json_text() == json.dumps(rows, separators=(",", ":")).encode()


@pytest.mark.parametrize("form", ["texts", "arrays", "both"])
def test_many_deltas_merged_one_at_a_time(form: str) -> None:
    """A consumer that falls behind: 300 one-token deltas merged into one, one at a time (merge_delta_outputs'
    order). The result's masks are the rows in order (json.dumps: the reference), it was read between merges (a read
    closes an owned text in place: the merge reopens it), and the first text block is the same object all along
    (appended to, not copied: the merge is linear in the delta)."""
    rng = np.random.default_rng(1)
    rows = [sorted(rng.choice(5000, size=int(rng.integers(0, 40)), replace=False).tolist()) for _ in range(300)]

    def delta(r: list[int]) -> SamplingMask:
        text = [json.dumps(r, separators=(",", ":")).encode()]
        array = [np.array(r, dtype=np.int32)]
        return {"texts": lambda: SamplingMask(texts=text), "arrays": lambda: SamplingMask(arrays=array),
                "both": lambda: SamplingMask(arrays=array, texts=text)}[form]()

    merged = delta(rows[0])
    first_block = merged._text[0][0] if merged._text is not None else None
    for k, r in enumerate(rows[1:], start=2):
        previous = merged
        merged = merged.concat(delta(r))
        if k % 50 == 0:
            want = json.dumps(rows[:k], separators=(",", ":")).encode()
            if form != "arrays":
                assert merged.json_text() == want
                assert previous.json_text() == json.dumps(rows[:k - 1], separators=(",", ":")).encode()
            np.testing.assert_array_equal(merged.offsets, np.cumsum([0] + [len(x) for x in rows[:k]]))
    assert merged.token_ids == rows and len(merged) == 300
    if form != "arrays":
        assert merged._text[0][0] is first_block
        assert merged.json_text() == json.dumps(rows, separators=(",", ":")).encode()
