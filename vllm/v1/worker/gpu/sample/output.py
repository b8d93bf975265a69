"""Upstream's module path of `SamplingMaskTensors` (`vllm.v1.worker.gpu.sample.output`): a re-export of this
engine's class (vllm/v1/sample/sampling_mask.py), so RL code that imports it from there runs unchanged.

The class is the same object: `from_logits(logits, num_sampled_tokens, max_num_kept)` as upstream, with the
same fields (`token_ids`, `packed_mask`, `counts`, `vocab_size`) plus this engine's optional prepacked ones.
"""

from vllm.v1.outputs import SamplingMaskLists
from vllm.v1.sample.sampling_mask import MAX_COMPACT_SUPPORT, SamplingMaskTensors

__all__ = ["MAX_COMPACT_SUPPORT", "SamplingMaskLists", "SamplingMaskTensors"]
