"""SamplingMask: the list form (upstream's token_ids) and the compact form (ids + counts) agree."""

import numpy as np
import pytest

from vllm.outputs import SamplingMask


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
