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
from vllm.v1.outputs import LogprobsLists, SamplingMaskLists

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


def pack_step_arrays(outputs: EngineCoreOutputs) -> EngineCoreOutputs:
    """A copy of `outputs` whose per-output logprobs / masks are concatenated into `step_arrays`:
    (lp_outputs, lp_rows, lp_token_ids, lp_logprobs, lp_ranks, mask_outputs, mask_positions, mask_sizes,
    mask_token_ids): the indices of the outputs that carry logprobs and their row counts, the rows stacked;
    the same for masks with one size per position and every position's ids concatenated."""
    outs = outputs.outputs
    lp = [(i, o.new_logprobs) for i, o in enumerate(outs) if o.new_logprobs is not None]
    masks = [(i, o.new_sampling_mask) for i, o in enumerate(outs) if o.new_sampling_mask is not None]
    if not lp and not masks:
        return outputs
    lp_arrays: tuple[Any, ...] = (None, None, None)
    if lp:
        lp_arrays = tuple(np.concatenate([np.asarray(x[f]) for _, x in lp]) for f in range(3))
    sizes: list[int] = []
    positions: list[int] = []
    for _, m in masks:
        if m.offsets is None:
            sizes.append(len(m.token_ids))
            positions.append(1)
        else:
            sizes.extend(np.diff(m.offsets).tolist())
            positions.append(len(m.offsets) - 1)
    mask_ids = np.concatenate([m.token_ids for _, m in masks]).astype(np.int32, copy=False) if masks else None
    new_outs = [o if o.new_logprobs is None and o.new_sampling_mask is None
                else msgspec.structs.replace(o, new_logprobs=None, new_sampling_mask=None) for o in outs]
    step_arrays = ([i for i, _ in lp], [len(x.logprob_token_ids) for _, x in lp], *lp_arrays,
                   [i for i, _ in masks], positions, np.array(sizes, dtype=np.int64), mask_ids)
    return msgspec.structs.replace(outputs, outputs=new_outs, step_arrays=step_arrays)


def unpack_step_arrays(outputs: EngineCoreOutputs) -> None:
    """Inverse of `pack_step_arrays`, in place: every output gets its LogprobsLists (lists of Python numbers,
    row p = position p) and SamplingMaskLists (int32 views, offsets None for one position) back."""
    if outputs.step_arrays is None:
        return
    lp_outputs, lp_rows, lp_ids, lp_values, lp_ranks, mask_outputs, mask_positions, sizes, mask_ids = \
        outputs.step_arrays
    outputs.step_arrays = None
    outs = outputs.outputs
    if lp_outputs:
        ids, values, ranks = lp_ids.tolist(), lp_values.tolist(), lp_ranks.tolist()
        p = 0
        for i, n in zip(lp_outputs, lp_rows):
            outs[i].new_logprobs = LogprobsLists(ids[p:p + n], values[p:p + n], ranks[p:p + n], None)
            p += n
    if mask_outputs:
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        offs = offsets.tolist()
        p = 0
        for i, n in zip(mask_outputs, mask_positions):
            lo = offs[p]
            outs[i].new_sampling_mask = (SamplingMaskLists(mask_ids[lo:offs[p + 1]], None, None) if n == 1 else
                                         SamplingMaskLists(mask_ids[lo:offs[p + n]], offsets[p:p + n + 1] - lo))
            p += n
