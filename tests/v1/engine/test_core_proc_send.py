"""EngineCoreProc.send over a real ZMQ PUSH/PULL pair: a step's outputs with a mask text large enough for a frame of
its own (a zero-copy frame) arrive whole; send_outputs with
several clients: each client's share of the step-level rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zmq

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.core_proc import OUTPUTS, EngineCoreProc
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists, SamplingMaskText, StepLogprobs, StepMasks
from vllm.v1.sample.sampling_mask import group_order
from vllm.v1.serial_utils import AUX_FRAME_MIN_BYTES, MsgpackDecoder, MsgpackEncoder


def test_send_delivers_large_mask_frames() -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        proc = EngineCoreProc.__new__(EngineCoreProc)  # the sending half only: no engine, no input sockets
        proc.output_sockets, proc.encoder = [push], MsgpackEncoder()
        rows = [b"[" + b",".join(str(i).encode() for i in range(r, r + 6000)) + b"]" for r in range(3)]
        text = np.frombuffer(b"".join(rows), dtype=np.uint8)
        assert text.nbytes >= AUX_FRAME_MIN_BYTES  # travels as a frame of its own
        outs = [EngineCoreOutput(f"r{r}", [7 + r], new_sampling_mask_text=SamplingMaskText(
            text[sum(map(len, rows[:r])):sum(map(len, rows[:r + 1]))], None)) for r in range(3)]
        proc.send(OUTPUTS, EngineCoreOutputs(outputs=outs))
        frames = pull.recv_multipart(copy=False)
        assert frames[0].bytes == OUTPUTS and len(frames) >= 3
        got = MsgpackDecoder(EngineCoreOutputs).decode(frames[1].buffer, [f.buffer for f in frames[2:]])
        assert [o.request_id for o in got.outputs] == ["r0", "r1", "r2"]
        assert [bytes(o.new_sampling_mask_text.text) for o in got.outputs] == rows
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


class _FrameLog:
    """A PUSH socket stand-in that keeps each message's frames as bytes."""

    def __init__(self) -> None:
        self.messages: list[list[bytes]] = []

    def send_multipart(self, frames, copy: bool = True) -> None:
        self.messages.append([bytes(f) for f in frames])


def _step(n: int, client: list[int], wants_mask: list[bool], out_rows: list[int]) -> tuple[EngineCoreOutputs, list]:
    """A decode step of n runner rows whose outputs are `out_rows` (runner rows, in output order), with the mask
    texts packed by client as the device packs them (rows of a client together, clients ascending, row order
    within one); rows that carry no mask still take their place in the packing ("[]"), as padding rows do."""
    rows = [[r * 10 + j for j in range(r % 3 + 1)] for r in range(n)]
    texts = [json.dumps(r, separators=(",", ":")).encode() if wants_mask[i] else b"[]" for i, r in enumerate(rows)]
    order, rank = group_order(np.array(client))
    packed = b"".join(texts[r] for r in order)
    offsets = np.cumsum([0] + [len(texts[r]) for r in order]).astype(np.int64)
    flat = np.array([i for r in rows for i in r], dtype=np.int32)
    mask_offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    lp = LogprobsLists(np.array([[r, r + 1] for r in range(n)], dtype=np.int32),
                       np.array([[-r / 8, -1.0] for r in range(n)], dtype=np.float32),
                       np.arange(n, dtype=np.int32) % 5 + 1)
    outs = [EngineCoreOutput(f"r{r}", [r]) for r in out_rows]
    rows_np = np.array(out_rows, dtype=np.int64)
    all_out = np.arange(len(out_rows), dtype=np.int64)
    masked = np.flatnonzero(np.array(wants_mask)[rows_np]).astype(np.int64)
    ones = np.ones(len(out_rows), dtype=np.int64)
    outputs = EngineCoreOutputs(
        outputs=outs,
        step_logprobs=StepLogprobs(lp, all_out, rows_np, ones),
        step_masks=StepMasks(SamplingMaskLists(flat, mask_offsets),
                             SamplingMaskText(np.frombuffer(packed, np.uint8), offsets, None, rank),
                             masked, rows_np[masked], ones[masked]))
    return outputs, texts


@pytest.mark.parametrize("case", ["decode", "row-without-mask", "first-row-without-mask", "outputs-out-of-row-order",
                                  "client-without-outputs", "client-without-masks", "padding-rows"])
def test_send_outputs_cuts_each_clients_share(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """EngineCoreProc.send_outputs with several clients: each client gets exactly its requests' outputs, logprobs
    and mask texts (against the rows built here). A decode step (every output carries a mask, outputs in row
    order) has its texts cut in one pass (StepMasks.text_shares); the other cases fall back to selecting and
    gathering per client. Either way the bytes on the wire are those of the per-client path."""
    n, num_clients = 11, 3
    client = [1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 0]
    wants_mask = [True] * n
    out_rows = list(range(n))
    one_pass = case in ("decode", "client-without-outputs", "client-without-masks", "padding-rows")
    if case == "row-without-mask":
        wants_mask[4] = False
    elif case == "first-row-without-mask":  # the packing's first row (client 0's first) carries no mask
        wants_mask[1] = False
    elif case == "client-without-outputs":  # the last client owns no request this step
        num_clients = 4
    elif case == "client-without-masks":  # its outputs carry logprobs only
        wants_mask = [c != 2 for c in client]
    elif case == "padding-rows":  # the runner's rows past the outputs (a padded graph step) pack after them
        out_rows = list(range(n - 2))
        client[n - 2:] = [3, 3]  # MASK_GROUP_PAD-like: a group after every real row's
    elif case == "outputs-out-of-row-order":
        out_rows = [0, 1, 2, 4, 3] + list(range(5, n))  # rows 3 and 4 are both client 1's
    calls: list[bool] = []
    real_text_shares = StepMasks.text_shares

    def spy(self, *args):
        shares = real_text_shares(self, *args)
        calls.append(shares is not None)
        return shares

    def send_step(use_shares: bool) -> list[list[list[bytes]]]:
        monkeypatch.setattr(StepMasks, "text_shares", spy if use_shares else lambda self, *a: None)
        proc = EngineCoreProc.__new__(EngineCoreProc)  # the sending half only
        proc.output_sockets = [_FrameLog() for _ in range(num_clients)]
        proc.encoder = MsgpackEncoder()
        proc.client_of = {f"r{r}": client[r] for r in range(n)}
        proc.aborted_client = {}
        outputs, _ = _step(n, client, wants_mask, out_rows)
        proc.send_outputs(outputs)
        return [s.messages for s in proc.output_sockets]

    fast, reference = send_step(True), send_step(False)
    assert calls == [one_pass]
    assert fast == reference
    _, texts = _step(n, client, wants_mask, out_rows)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    for c, messages in enumerate(fast):
        mine = [r for r in out_rows if client[r] == c]
        if not mine:  # a client with nothing this step (no outputs, no stats) gets no message
            assert messages == []
            continue
        (frames,) = messages
        got = decoder.decode(frames[1], frames[2:])
        assert [o.request_id for o in got.outputs] == [f"r{r}" for r in mine]
        for o, r in zip(got.outputs, mine):
            assert o.new_logprobs[0] == [[r, r + 1]] and o.new_logprobs[2] == [r % 5 + 1]
            if wants_mask[r]:
                assert bytes(o.new_sampling_mask_text.text) == texts[r]
            else:
                assert o.new_sampling_mask_text is None
