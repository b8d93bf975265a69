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
  masks as int32 views of the step's id array.
- Object arrays are refused (they would need pickle).
"""

from __future__ import annotations

import struct
from typing import Any

import msgspec
import numpy as np

from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists, SamplingMaskText

NDARRAY_EXT_CODE = 1
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


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == NDARRAY_EXT_CODE:
        return _decode_ndarray(data)
    raise NotImplementedError(f"Unknown msgpack extension code {code}.")


def _dec_hook(type_: type, obj: Any) -> Any:
    if type_ is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise NotImplementedError(f"Cannot decode {type_!r}.")


class MsgpackEncoder:
    """Encodes msgspec structs (and anything msgpack takes) with ndarray support; reuse one per thread."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)

    def encode(self, obj: Any) -> bytes:
        if isinstance(obj, EngineCoreOutputs):
            obj = pack_step_arrays(obj)
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Decodes into `t` (a struct type, or Any) with ndarray support; restores the NamedTuples in outputs."""

    def __init__(self, t: Any = Any) -> None:
        self.type = t
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=_ext_hook, dec_hook=_dec_hook)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        obj = self._decoder.decode(data)
        if isinstance(obj, EngineCoreOutputs):
            unpack_step_arrays(obj)
        return obj


def _pack_csr(items: list[tuple[int, Any]], field: str) -> tuple[list[int], list[int], np.ndarray | None,
                                                                  np.ndarray | None]:
    """(output indices, positions per output, one size per position, the data concatenated) of the
    SamplingMaskLists / SamplingMaskText slices in `items` (`field` names their data array)."""
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
        return [], [], None, None
    data = np.concatenate([getattr(m, field) for _, m in items])
    return [i for i, _ in items], positions, np.array(sizes, dtype=np.int64), data


def _unpack_csr(outs: list[Any], attr: str, cls: Any, indices: list[int], positions: list[int],
                sizes: np.ndarray, data: np.ndarray) -> None:
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    offs = offsets.tolist()
    p = 0
    for i, n in zip(indices, positions):
        lo = offs[p]
        setattr(outs[i], attr, cls(data[lo:offs[p + 1]], None, None) if n == 1 else
                cls(data[lo:offs[p + n]], offsets[p:p + n + 1] - lo))
        p += n


def pack_step_arrays(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """A copy of `outputs` whose per-output logprobs / masks / mask texts are concatenated into `step_arrays`:
    (lp_outputs, lp_rows, lp_token_ids, lp_logprobs, lp_ranks, *mask_csr, *text_csr): the indices of the outputs
    that carry logprobs and their row counts, the rows stacked; for masks and their JSON texts, the output
    indices, positions per output, one size per position and every position's data concatenated."""
    outs = outputs.outputs
    step_masks = outputs.step_masks
    lp = [(i, o.new_logprobs) for i, o in enumerate(outs) if o.new_logprobs is not None]
    masks = [(i, o.new_sampling_mask) for i, o in enumerate(outs) if o.new_sampling_mask is not None]
    texts = [(i, o.new_sampling_mask_text) for i, o in enumerate(outs) if o.new_sampling_mask_text is not None]
    if not lp and not masks and not texts and step_masks is None:
        return outputs
    lp_arrays: tuple[Any, ...] = (None, None, None)
    if lp:
        lp_arrays = tuple(np.concatenate([np.asarray(x[f]) for _, x in lp]) for f in range(3))
    if step_masks is not None:
        # NOTE: the scheduler left the rows in the step's arrays: one numpy gather per step, no per-output work.
        assert not masks and not texts, "an output carries both its own mask and a StepMasks row"
        indices, positions = step_masks.out_index.tolist(), step_masks.num_pos.tolist()
        mask_csr: tuple[Any, ...] = (indices, positions, *step_masks.gather())
        text_csr: tuple[Any, ...] = ((indices, positions, *step_masks.gather(text=True))
                                     if step_masks.texts is not None else ([], [], None, None))
    else:
        mask_csr, text_csr = _pack_csr(masks, "token_ids"), _pack_csr(texts, "text")
    if mask_csr[3] is not None:
        mask_csr = (*mask_csr[:3], mask_csr[3].astype(np.int32, copy=False))
    new_outs = [o if o.new_logprobs is None and o.new_sampling_mask is None and o.new_sampling_mask_text is None
                else msgspec.structs.replace(o, new_logprobs=None, new_sampling_mask=None,
                                             new_sampling_mask_text=None) for o in outs]
    step_arrays = ([i for i, _ in lp], [len(x.logprob_token_ids) for _, x in lp], *lp_arrays, *mask_csr,
                   *text_csr)
    return msgspec.structs.replace(outputs, outputs=new_outs, step_arrays=step_arrays, step_masks=None)


def unpack_step_arrays(outputs: EngineCoreOutputs) -> None:
    """Inverse of `pack_step_arrays`, in place: every output gets its LogprobsLists (lists of Python numbers,
    row p = position p), SamplingMaskLists (int32 views) and SamplingMaskText (uint8 views) back, offsets None
    for one position."""
    if outputs.step_arrays is None:
        return
    lp_outputs, lp_rows, lp_ids, lp_values, lp_ranks = outputs.step_arrays[:5]
    mask_csr, text_csr = outputs.step_arrays[5:9], outputs.step_arrays[9:13]
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
