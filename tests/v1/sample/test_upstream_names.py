"""The names RL code imports from upstream vLLM's module paths (issue 26, item 6): same objects, upstream's
signatures, behaviour checked against float64 / hand-worked references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.platforms import current_platform
from vllm.v1.outputs import SamplingMaskLists
from vllm.v1.sample.sampling_mask import SamplingMaskTensors


def _support_rows(logits: torch.Tensor, sampled: torch.Tensor) -> list[list[int]]:
    return [torch.isfinite(row).nonzero().flatten().tolist() if n > 0 else []
            for row, n in zip(logits, sampled.tolist())]


def test_sampling_mask_tensors_upstream_path_and_keywords() -> None:
    from vllm.v1.worker.gpu.sample.output import SamplingMaskTensors as Upstream
    assert Upstream is SamplingMaskTensors
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    logits[logits < 0.3] = float("-inf")
    sampled = torch.tensor([1, 0, 1, 1], dtype=torch.int32)
    expected = _support_rows(logits, sampled)  # the row that sampled nothing is empty
    upstream = Upstream.from_logits(logits, num_sampled_tokens=sampled, max_num_kept=8)
    positional = Upstream.from_logits(logits, sampled, 8)
    older = SamplingMaskTensors.from_logits(logits, num_sampled=sampled, max_num_kept=8)
    for mask in (upstream, positional, older):
        assert mask.counts.tolist() == [len(r) for r in expected]
        assert mask.tolists().to_nested_list() == expected
    with pytest.raises(TypeError):
        SamplingMaskTensors.from_logits(logits, sampled, 8, num_sampled=sampled)


def test_sampling_mask_lists_offsets_default_none() -> None:
    lists = SamplingMaskLists(np.array([3, 5, 9], dtype=np.int32))
    assert lists.offsets is None and lists.cu_num_generated_tokens is None
    assert lists.to_nested_list() == [[3, 5, 9]]


def _reference_top_k_top_p(row: np.ndarray, k: int, p: float) -> set[int]:
    """float64, distinct logits: the k largest, then the smallest prefix (by probability) reaching mass p."""
    order = np.argsort(-row, kind="stable")
    kept = order[:k] if 0 < k < len(row) else order
    probs = np.exp(row[kept] - row[kept].max())
    probs /= probs.sum()
    cum = np.cumsum(probs)
    last = int(np.searchsorted(cum, p)) if p < 1.0 else len(kept) - 1
    return set(kept[:min(last, len(kept) - 1) + 1].tolist())


def test_apply_top_k_top_p_upstream_signature() -> None:
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    gen = torch.Generator().manual_seed(1)
    num_reqs, vocab = 6, 40
    logits = torch.randn(num_reqs, vocab, generator=gen, dtype=torch.float64).to(torch.float32)
    k = torch.tensor([5, vocab, 1, 0, 12, 3])  # vocab and 0: no top-k on that row
    p = torch.tensor([0.9, 0.5, 1.0, 1.0, 0.3, 1.0])
    original = logits.clone()
    out = apply_top_k_top_p(logits, k, p)
    assert out is logits
    for r in range(num_reqs):
        kept = set(torch.isfinite(out[r]).nonzero().flatten().tolist())
        assert kept == _reference_top_k_top_p(original[r].double().numpy(), int(k[r]), float(p[r])), r
        assert torch.equal(out[r][torch.isfinite(out[r])], original[r][torch.isfinite(out[r])])
    same = original.clone()
    assert torch.equal(apply_top_k_top_p(same, None, None), original)
    only_k = original.clone()
    apply_top_k_top_p(only_k, torch.full((num_reqs,), 2), None)
    assert (torch.isfinite(only_k).sum(dim=1) == 2).all()


def test_current_platform_fields() -> None:
    cuda = torch.cuda.is_available()
    assert current_platform.device_type == ("cuda" if cuda else "cpu")
    assert current_platform.is_cuda() is cuda and current_platform.is_cuda_alike() is cuda
    assert current_platform.is_cpu() is not cuda
    assert not current_platform.is_rocm() and not current_platform.is_xpu() and not current_platform.is_tpu()
    assert current_platform.device_control_env_var == "CUDA_VISIBLE_DEVICES"
    assert current_platform.dist_backend == ("nccl" if cuda else "gloo")
    assert current_platform.device_count() == (torch.cuda.device_count() if cuda else 0)
    if not cuda:
        assert current_platform.get_device_capability() is None
        assert not current_platform.has_device_capability(80)
    else:
        major, minor = torch.cuda.get_device_capability()
        assert current_platform.get_device_capability().to_int() == major * 10 + minor
        assert current_platform.has_device_capability((major, minor))
