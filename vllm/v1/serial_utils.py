"""msgspec (msgpack) encoding for the engine-core protocol, with numpy arrays as a raw-buffer extension type.

An ndarray travels as msgpack extension `NDARRAY_EXT_CODE` whose payload is a small msgpack header
`(dtype.str, shape)` followed by the array's raw bytes; decoding wraps the received buffer with `np.frombuffer`
(no per-element Python objects on either side, and no copy on the receiving side).

Invariants:
- `decode(encode(x))` gives back equal structs; arrays keep dtype (byte order included), shape and values;
  decoded arrays are read-only views of the message buffer.
- The wire structs keep `new_logprobs` / `new_sampling_mask` as `Any`, so msgpack alone would return the
  LogprobsLists / SamplingMaskLists NamedTuples as lists: `MsgpackDecoder` rebuilds them for EngineCoreOutputs.
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
        return self._encoder.encode(obj)


class MsgpackDecoder:
    """Decodes into `t` (a struct type, or Any) with ndarray support; restores the NamedTuples in outputs."""

    def __init__(self, t: Any = Any) -> None:
        self.type = t
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=_ext_hook, dec_hook=_dec_hook)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        obj = self._decoder.decode(data)
        if isinstance(obj, EngineCoreOutputs):
            restore_output_lists(obj)
        return obj


def _as_logprobs_lists(value: Any) -> LogprobsLists | None:
    if value is None or isinstance(value, LogprobsLists):
        return value
    token_ids, logprobs, ranks, cu = value
    return LogprobsLists(token_ids, logprobs, ranks, cu)


def _as_sampling_mask_lists(value: Any) -> SamplingMaskLists | None:
    if value is None or isinstance(value, SamplingMaskLists):
        return value
    token_ids, offsets, cu = value
    return SamplingMaskLists(token_ids, offsets, cu)


def restore_output_lists(outputs: EngineCoreOutputs) -> None:
    """Turn the decoded list forms of `new_logprobs` / `new_sampling_mask` back into their NamedTuples."""
    for output in outputs.outputs:
        if output.new_logprobs is not None:
            output.new_logprobs = _as_logprobs_lists(output.new_logprobs)
        if output.new_sampling_mask is not None:
            output.new_sampling_mask = _as_sampling_mask_lists(output.new_sampling_mask)
