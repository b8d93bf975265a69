"""EngineCoreProc.send over a real ZMQ PUSH/PULL pair: a step's outputs with a mask text large enough for a frame of
its own (zero-copy by default, copied with VLLM_ENGINE_SEND_COPY=1) arrive whole either way."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from vllm import envs
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.core_proc import OUTPUTS, EngineCoreProc
from vllm.v1.outputs import SamplingMaskText
from vllm.v1.serial_utils import AUX_FRAME_MIN_BYTES, MsgpackDecoder, MsgpackEncoder


@pytest.mark.parametrize("send_copy", [False, True])
def test_send_delivers_large_mask_frames(monkeypatch: pytest.MonkeyPatch, send_copy: bool) -> None:
    monkeypatch.setenv("VLLM_ENGINE_SEND_COPY", "1" if send_copy else "0")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        proc = EngineCoreProc.__new__(EngineCoreProc)  # the sending half only: no engine, no input sockets
        proc.output_sockets, proc.encoder = [push], MsgpackEncoder()
        proc.send_copy = envs.VLLM_ENGINE_SEND_COPY
        assert proc.send_copy is send_copy
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
