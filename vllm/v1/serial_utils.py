"""msgspec (msgpack) encoding for the engine-core protocol, with numpy arrays as a raw-buffer extension type.

An ndarray travels as msgpack extension `NDARRAY_EXT_CODE` whose payload is a small msgpack header
`(dtype.str, shape)` followed by the array's raw bytes; decoding wraps the received buffer with `np.frombuffer`
(no per-element Python objects on either side, and no copy on the receiving side).

Invariants:
- `decode(encode(x))` gives back equal structs; arrays keep dtype (byte order included), shape and values;
  decoded arrays are read-only views of the message buffer.
- EngineCoreOutputs travel with their outputs' logprobs and sampling masks moved into a few step-level arrays
  (`pack_step_arrays`): a handful of extension payloads per step instead of three or four per request, whose
  decoding cost the frontend ~10 us each. `MsgpackDecoder` puts them back per output (`unpack_step_arrays`):
  logprobs as Python lists (what the frontend turns them into anyway, converted with one `tolist()` per step),
  masks as int32 views of the step's id array. A mask with its JSON text (an API server's engine) travels as the
  text only (uint8 views), without its ids.
- Object arrays are refused (they would need pickle).
- `encode_frames` (the engine core's outputs) moves arrays of AUX_FRAME_MIN_BYTES or more out of the message
  into frames of their own, sent without a copy; the decoded arrays are views of those frames.
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists, SamplingMaskText, StepTextShare

NDARRAY_EXT_CODE = 1
# An ndarray whose bytes travel in a frame of their own (MsgpackEncoder.encode_frames); payload: a msgpack
# (dtype.str, shape, frame index).
AUX_NDARRAY_EXT_CODE = 2
# NOTE: arrays this large leave the msgpack body: copying several MB into it (and growing its buffer) cost
# ~7 ms per 1024-row masked step on the development machine, a separate zero-copy ZMQ frame costs nothing.
# Below 64 KiB ZMQ copies a frame anyway.
AUX_FRAME_MIN_BYTES = 1 << 16
_HEADER_LEN = struct.Struct("<I")


def _encode_ndarray(arr: np.ndarray) -> msgspec.msgpack.Ext:
    if arr.dtype.hasobject:
        raise TypeError("numpy arrays of dtype object cannot be serialized.")
    arr = np.ascontiguousarray(arr)
    header = msgspec.msgpack.encode((arr.dtype.str, arr.shape))
    # NOTE: one copy of the raw bytes into the extension payload; never a trip through Python lists.
    payload = b"".join((_HEADER_LEN.pack(len(header)), header, arr.data.cast("B") if arr.size else b""))
    return msgspec.msgpack.Ext(NDARRAY_EXT_CODE, payload)


def _decode_ndarray(data: memoryview | bytes) -> np.ndarray:
    (header_len,) = _HEADER_LEN.unpack_from(data, 0)
    start = _HEADER_LEN.size
    dtype_str, shape = msgspec.msgpack.decode(data[start:start + header_len])
    dtype = np.dtype(dtype_str)
    return np.frombuffer(data, dtype=dtype, offset=start + header_len).reshape(shape)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return _encode_ndarray(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"Cannot serialize objects of type {type(obj).__name__}.")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"Cannot decode {type_!r}.")


class MsgpackEncoder:
    """Encodes msgspec structs (and anything msgpack takes) with ndarray support; reuse one per thread (not
    thread-safe: `encode_frames` collects its frames on the instance)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._aux: list[memoryview] | None = None

    def _enc_hook(self, obj: Any) -> Any:
        if self._aux is not None and isinstance(obj, np.ndarray) and obj.nbytes >= AUX_FRAME_MIN_BYTES \
                and not obj.dtype.hasobject:
            arr = np.ascontiguousarray(obj)
            self._aux.append(arr.data.cast("B"))
            return msgspec.msgpack.Ext(AUX_NDARRAY_EXT_CODE,
                                       msgspec.msgpack.encode((arr.dtype.str, arr.shape, len(self._aux))))
        return _enc_hook(obj)

    def encode(self, obj: Any) -> bytes:
        """One msgpack message; arrays inline."""
        if isinstance(obj, EngineCoreOutputs):
            obj = pack_step_arrays(obj)
        return self._encoder.encode(obj)

    def encode_frames(self, obj: Any) -> list[bytes | memoryview]:
        """[msgpack message, *raw array frames]: arrays of AUX_FRAME_MIN_BYTES or more are not copied into the
        message but referenced, each as a frame of its own (send them with copy=False, and leave the arrays
        unchanged until sent); `MsgpackDecoder.decode(frames[0], frames[1:])` reads them back."""
        if isinstance(obj, EngineCoreOutputs):
            obj = pack_step_arrays(obj)
        self._aux = []
        try:
            message = self._encoder.encode(obj)
            return [message, *self._aux]
        finally:
            self._aux = None


class MsgpackDecoder:
    """Decodes into `t` (a struct type, or Any) with ndarray support; restores the NamedTuples in outputs.
    Reuse one per thread (not thread-safe: `decode` keeps its frames on the instance while it runs)."""

    def __init__(self, t: Any = Any) -> None:
        self.type = t
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook, dec_hook=_dec_hook)
        self._aux: list[Any] = []

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == NDARRAY_EXT_CODE:
            return _decode_ndarray(data)
        if code == AUX_NDARRAY_EXT_CODE:
            dtype_str, shape, index = msgspec.msgpack.decode(data)
            if not 1 <= index <= len(self._aux):
                raise ValueError(f"Array frame {index} missing: the message came with {len(self._aux)}.")
            return np.frombuffer(self._aux[index - 1], dtype=np.dtype(dtype_str)).reshape(shape)
        raise NotImplementedError(f"Unknown msgpack extension code {code}.")

    def decode(self, data: bytes | bytearray | memoryview, aux_frames: Any = ()) -> Any:
        """`data` a message; `aux_frames` the buffers of the frames that came after it (encode_frames)."""
        self._aux = list(aux_frames)
        try:
            obj = self._decoder.decode(data)
        finally:
            self._aux = []
        if isinstance(obj, EngineCoreOutputs):
            unpack_step_arrays(obj)
        return obj


def _pack_csr(items: list[tuple[int, Any]], field: str) -> tuple[list[int], list[int], np.ndarray | None,
                                                                  np.ndarray | None, np.ndarray | None]:
    """(output indices, positions per output, start and size of each position in the data, the data) of the
    SamplingMaskLists / SamplingMaskText slices in `items` (`field` names their data array), concatenated."""
    sizes: list[int] = []
    positions: list[int] = []
    for _, m in items:
        if m.offsets is None:
            sizes.append(len(getattr(m, field)))
            positions.append(1)
        else:
            sizes.extend(np.diff(m.offsets).tolist())
            positions.append(len(m.offsets) - 1)
    if not items:
        return [], [], None, None, None
    size_arr = np.array(sizes, dtype=np.int64)
    starts = np.cumsum(size_arr) - size_arr
    data = np.concatenate([getattr(m, field) for _, m in items])
    return [i for i, _ in items], positions, starts, size_arr, data


def _unpack_csr(outs: list[Any], attr: str, cls: Any, indices: list[int], positions: list[int],
                starts: np.ndarray, sizes: np.ndarray, data: np.ndarray) -> None:
    """Each output's positions are consecutive in `data` (one request's rows of a step are)."""
    lo, hi = starts.tolist(), (starts + sizes).tolist()
    p = 0
    for i, n in zip(indices, positions):
        first = lo[p]
        setattr(outs[i], attr, cls(data[first:hi[p]], None, None) if n == 1 else
                cls(data[first:hi[p + n - 1]], np.append(starts[p:p + n], hi[p + n - 1]) - first))
        p += n


def pack_step_arrays(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """A copy of `outputs` whose logprobs / masks / mask texts (per output, or step-level StepLogprobs /
    StepMasks, whose outputs carry none of their own) are concatenated into `step_arrays`: (lp_outputs, lp_rows,
    lp_token_ids, lp_logprobs, lp_ranks, *mask_csr, *text_csr): the indices of the outputs that carry logprobs and
    their row counts, the rows stacked; for masks and their JSON texts, the output indices, positions per output,
    each position's start and size in the data, and the data (per-output slices concatenated; StepMasks: a view of
    the step's arrays)."""
    outs = outputs.outputs
    step_logprobs, step_masks = outputs.step_logprobs, outputs.step_masks
    # NOTE: the scheduler's outputs carry their logprobs and masks as step-level rows and none of their own, so a
    # kind that is step-level is not scanned for in the outputs (three passes over every output of every step
    # otherwise); a kind that is not step-level still is (hand-built outputs may carry their own).
    lp = [] if step_logprobs is not None else [
        (i, o.new_logprobs) for i, o in enumerate(outs) if o.new_logprobs is not None]
    masks, texts = ([], []) if step_masks is not None else (
        [(i, o.new_sampling_mask) for i, o in enumerate(outs) if o.new_sampling_mask is not None],
        [(i, o.new_sampling_mask_text) for i, o in enumerate(outs) if o.new_sampling_mask_text is not None])
    if not lp and not masks and not texts and step_logprobs is None and step_masks is None:
        return outputs
    # NOTE: step-level rows (what the scheduler produces) cost one numpy gather per step, no per-output work.
    if step_logprobs is not None:
        lp_csr: tuple[Any, ...] = (step_logprobs.out_index.tolist(), step_logprobs.num_pos.tolist(),
                                   *step_logprobs.gather())
    elif lp:
        lp_csr = ([i for i, _ in lp], [len(x.logprob_token_ids) for _, x in lp],
                  *(np.concatenate([np.asarray(x[f]) for _, x in lp]) for f in range(3)))
    else:
        lp_csr = ([], [], None, None, None)
    # NOTE: a mask that has its JSON text (an API server's engine) travels as the text only: the server splices
    # the text into its responses and parses ids only if asked (SamplingMask), so the ids would be ~40% more
    # bytes per step for every API server to receive and cut for nothing.
    no_csr: tuple[Any, ...] = ([], [], None, None, None)
    if isinstance(step_masks, StepTextShare):  # one client's texts, already cut (EngineCoreProc.send_outputs)
        mask_csr, text_csr = no_csr, (step_masks.out_index.tolist(), step_masks.num_pos.tolist(),
                                      step_masks.starts, step_masks.sizes, step_masks.data)
    elif step_masks is not None:
        indices, positions = step_masks.out_index.tolist(), step_masks.num_pos.tolist()
        if step_masks.texts is not None:
            mask_csr, text_csr = no_csr, (indices, positions, *step_masks.gather(text=True))
        else:
            mask_csr, text_csr = (indices, positions, *step_masks.gather()), no_csr
    else:
        with_text = {i for i, _ in texts}
        mask_csr = _pack_csr([(i, m) for i, m in masks if i not in with_text], "token_ids")
        text_csr = _pack_csr(texts, "text")
    if mask_csr[4] is not None:
        mask_csr = (*mask_csr[:4], mask_csr[4].astype(np.int32, copy=False))
    new_outs = outs if not lp and not masks and not texts else [
        o if o.new_logprobs is None and o.new_sampling_mask is None and o.new_sampling_mask_text is None
        else msgspec.structs.replace(o, new_logprobs=None, new_sampling_mask=None, new_sampling_mask_text=None)
        for o in outs]
    return msgspec.structs.replace(outputs, outputs=new_outs, step_arrays=(*lp_csr, *mask_csr, *text_csr),
                                   step_logprobs=None, step_masks=None)


def unpack_step_arrays(outputs: EngineCoreOutputs) -> None:
    """Inverse of `pack_step_arrays`, in place: every output gets its LogprobsLists (lists of Python numbers,
    row p = position p), SamplingMaskLists (int32 views) and SamplingMaskText (uint8 views) back, offsets None
    for one position."""
    if outputs.step_arrays is None:
        return
    lp_outputs, lp_rows, lp_ids, lp_values, lp_ranks = outputs.step_arrays[:5]
    mask_csr, text_csr = outputs.step_arrays[5:10], outputs.step_arrays[10:15]
    outputs.step_arrays = None
    outs = outputs.outputs
    if lp_outputs:
        ids, values, ranks = lp_ids.tolist(), lp_values.tolist(), lp_ranks.tolist()
        p = 0
        for i, n in zip(lp_outputs, lp_rows):
            outs[i].new_logprobs = LogprobsLists(ids[p:p + n], values[p:p + n], ranks[p:p + n], None)
            p += n
    if mask_csr[0]:
        _unpack_csr(outs, "new_sampling_mask", SamplingMaskLists, *mask_csr)
    if text_csr[0]:
        _unpack_csr(outs, "new_sampling_mask_text", SamplingMaskText, *text_csr)
