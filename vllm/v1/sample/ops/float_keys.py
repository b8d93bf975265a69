"""Order-preserving int32 keys of float32 values, for selecting by key in Triton kernels.

Role: `float_to_key` maps z to an int32 whose signed order is the float order, `key_to_float` maps it back; the
radix select (topk_select.py) and the prefilter (topk_prefilter.py) find k-th largest values as keys.

Invariants:
- -0.0 and +0.0 get one key (they are equal as floats), and that key maps back to +0.0.
- NaN keys lie above +inf's (positive NaN) or below -inf's (negative NaN); every other key maps back to its float.
"""

import triton
import triton.language as tl


@triton.jit
def float_to_key(z):
    """float32 z -> int32 keys whose signed order is the float order."""
    bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def key_to_float(key):
    """The inverse of `float_to_key` (a zero key gives +0.0)."""
    return tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)
