"""The fused Triton kernels of vllm/model_executor/layers/fused_ops.py against a float64 reference and against
the layers' torch code (forward_native), which they must round like.

On a CUDA machine the kernels run compiled on the GPU; otherwise interpreted on CPU tensors (TRITON_INTERPRET=1,
set by tests/conftest.py), so shapes stay small there. The CUDA-only tests add model-sized shapes and CUDA graph
capture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import triton
from hf_model_utils import PagedRunner, make_hf_model

from vllm.config.model import ModelConfig
from vllm.model_executor.layers import activation, fused_ops, layernorm, rotary_embedding
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.model_loader import get_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_interpreter = pytest.mark.skipif(not triton.knobs.runtime.interpret,
                                       reason="CPU tensors through Triton need TRITON_INTERPRET")
# (rtol, atol) of the kernels against float64, a few roundings of each dtype.
REF_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}


def assert_matches_native(out: torch.Tensor, native: torch.Tensor) -> None:
    """float32: allclose, tight. 16-bit: bitwise equal on >= 99% of elements, and elsewhere within 2 ulps.

    NOTE: 2, not 1: a 1-ulp flip of a rounded intermediate (x * rstd, from the variance's reduction order) is
    multiplied by the weight, which moves the output by up to 2 ulps of its own binade."""
    assert out.dtype == native.dtype and out.shape == native.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, native, rtol=1e-5, atol=1e-6)
        return
    if out.numel() == 0:
        return
    mantissa_bits = {torch.float16: 10, torch.bfloat16: 7}[out.dtype]
    a, b = out.double(), native.double()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))  # |x| in [2^(e-1), 2^e)
    ulp = torch.ldexp(torch.ones_like(a), exponent - 1 - mantissa_bits).clamp(min=torch.finfo(out.dtype).tiny)
    assert bool(((a - b).abs() <= 2 * ulp).all()), f"max diff {(a - b).abs().max().item()}"
    assert (out == native).double().mean().item() >= 0.99


def assert_matches_reference(out: torch.Tensor, ref: torch.Tensor, scale: float = 1.0) -> None:
    """scale: the magnitude of the rounded intermediates (rotary: of the inputs, whose products cancel)."""
    rtol, atol = REF_TOL[out.dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol * max(scale, 1.0))


class _NoLaunch:
    def __getitem__(self, grid: object) -> None:
        raise AssertionError(f"kernel launched with grid {grid}")


def _not_called(*args: object, **kwargs: object) -> None:
    raise AssertionError("the fused kernel ran on a CPU tensor")


# ---------------------------------------------------------------------------------------------------- RMSNorm


def make_norm(hidden_size: int, dtype: torch.dtype, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps=1e-6).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(hidden_size, generator=torch.Generator().manual_seed(seed)))
    return norm


def norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # float64
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows,hidden_size,max_tile", [(7, 896, None), (33, 1536, None),
                                                           (5, 1536, fused_ops.CUDA_TILE["rms_norm"])])
def test_rms_norm(num_rows: int, hidden_size: int, max_tile: int | None, dtype: torch.dtype) -> None:
    norm = make_norm(hidden_size, dtype)
    x = randn(num_rows, hidden_size, dtype=dtype, seed=1, scale=3.0)
    out = fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon, max_tile=max_tile)
    assert out.is_contiguous()
    assert_matches_native(out, norm.forward_native(x))
    assert_matches_reference(out, norm_reference(x, norm.weight, norm.variance_epsilon))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_rows", [1, 9])
def test_rms_norm_with_residual(num_rows: int, dtype: torch.dtype) -> None:
    norm = make_norm(1536, dtype)
    # NOTE: x is a column slice of a wider tensor, so its rows are strided.
    x = randn(num_rows, 1600, dtype=dtype, seed=2, scale=2.0)[:, 32:1568]
    residual = randn(num_rows, 1536, dtype=dtype, seed=3, scale=4.0)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = fused_ops.rms_norm(x, norm.weight, norm.variance_epsilon, residual)
    native_out, native_residual = norm.forward_native(x, residual)
    # The add is one rounding of the exact sum, in torch as in the kernel: bitwise equal.
    assert torch.equal(residual_out, native_residual)
    assert_matches_native(out, native_out)
    assert_matches_reference(out, norm_reference(residual_out, norm.weight, norm.variance_epsilon))
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128])
def test_rms_norm_on_heads_of_a_qkv_slice(head_size: int, dtype: torch.dtype) -> None:
    """Qwen3's qk_norm: [n, heads, head_size] views of a qkv column slice (strided rows and heads)."""
    n, num_heads, num_kv_heads = 5, 6, 2
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(n, q_size + 2 * kv_size, dtype=dtype, seed=4, scale=2.0)
    _, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    heads = k.reshape(n, num_kv_heads, head_size)
    assert heads.stride() == (q_size + 2 * kv_size, head_size, 1)
    norm = make_norm(head_size, dtype, seed=5)
    out = fused_ops.rms_norm(heads, norm.weight, norm.variance_epsilon)
    assert out.shape == heads.shape and out.is_contiguous()
    assert_matches_native(out, norm.forward_native(heads))
    assert_matches_reference(out, norm_reference(heads, norm.weight, norm.variance_epsilon))


def test_rms_norm_zero_rows_launch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "_rms_norm_kernel", _NoLaunch())
    norm = make_norm(896, torch.bfloat16)
    x = torch.empty(0, 896, dtype=torch.bfloat16, device=DEVICE)
    assert fused_ops.rms_norm(x, norm.weight, 1e-6).shape == (0, 896)
    out, residual_out = fused_ops.rms_norm(x, norm.weight, 1e-6, torch.empty_like(x))
    assert out.shape == residual_out.shape == (0, 896)


# ------------------------------------------------------------------------------------------------- SiluAndMul


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:  # float64
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,max_tile", [((5, 2 * 1000), None), ((3, 2 * 8960), None), ((2, 3, 2 * 320), None),
                                            ((3, 2 * 1000), fused_ops.CUDA_TILE["silu_and_mul"])])
def test_silu_and_mul(shape: tuple[int, ...], max_tile: int | None, dtype: torch.dtype) -> None:
    x = randn(*shape, dtype=dtype, seed=6, scale=3.0)
    out = fused_ops.silu_and_mul(x, max_tile=max_tile)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.is_contiguous()
    assert_matches_native(out, SiluAndMul().forward_native(x))
    assert_matches_reference(out, silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_strided_rows(dtype: torch.dtype) -> None:
    x = randn(4, 2 * 896 + 64, dtype=dtype, seed=7, scale=3.0)[:, 64:]
    assert not x.is_contiguous()
    out = fused_ops.silu_and_mul(x)
    assert_matches_native(out, SiluAndMul().forward_native(x))
    assert_matches_reference(out, silu_and_mul_reference(x))


def test_silu_and_mul_zero_rows_launch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "_silu_and_mul_kernel", _NoLaunch())
    x = torch.empty(0, 2 * 1000, dtype=torch.bfloat16, device=DEVICE)
    assert fused_ops.silu_and_mul(x).shape == (0, 1000)


# ------------------------------------------------------------------------------------------------- rotary


def rotary_reference(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor,
                     head_size: int) -> torch.Tensor:  # float64, neox style from the float32 cache
    n = x.shape[0]
    cos, sin = cos_sin_cache.double()[positions.long()].chunk(2, dim=-1)  # [n, head_size // 2]
    x1, x2 = x.double().reshape(n, -1, head_size).chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(n, -1)


def make_qkv(n: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype, seed: int):
    """q, k, v: column slices of one fused qkv output (row stride q_size + 2 * kv_size), as LlamaAttention has."""
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = randn(n, q_size + 2 * kv_size, dtype=dtype, seed=seed, scale=2.0)
    return qkv.split([q_size, kv_size, kv_size], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,head_size,num_heads,num_kv_heads,max_tile", [
    (5, 64, 14, 2, None), (3, 128, 12, 2, None), (2, 128, 4, 4, None),
    (5, 64, 6, 2, fused_ops.CUDA_TILE["rotary"]), (3, 128, 2, 1, 128)])
def test_rotary_on_qkv_slices(n: int, head_size: int, num_heads: int, num_kv_heads: int, max_tile: int | None,
                              dtype: torch.dtype) -> None:
    max_position = 4096
    rope = get_rope(head_size, max_position, {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                              "original_max_position_embeddings": 1024}).to(DEVICE)
    positions = torch.randint(0, max_position, (n,), generator=torch.Generator().manual_seed(8)).to(DEVICE)
    positions[0] = max_position - 1
    q, k, _ = make_qkv(n, num_heads, num_kv_heads, head_size, dtype, seed=9)
    assert not q.is_contiguous() and not k.is_contiguous()
    q_before, k_before = q.clone(), k.clone()
    q_out, k_out = fused_ops.rotary_embedding(positions, q, k, rope.cos_sin_cache, head_size, max_tile=max_tile)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    q_native, k_native = rope.forward_native(positions, q, k)
    assert_matches_native(q_out, q_native)
    assert_matches_native(k_out, k_native)
    scale = 1.2 * float(torch.cat((q, k), dim=-1).abs().max())  # |cos|, |sin| <= the yarn attention factor
    assert_matches_reference(q_out, rotary_reference(positions, q, rope.cos_sin_cache, head_size), scale)
    assert_matches_reference(k_out, rotary_reference(positions, k, rope.cos_sin_cache, head_size), scale)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)


def test_rotary_zero_rows_launch_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ops, "_rotary_kernel", _NoLaunch())
    rope = get_rope(64, 128, {"rope_type": "default", "rope_theta": 10000.0}).to(DEVICE)
    q, k, _ = make_qkv(0, 4, 2, 64, torch.bfloat16, seed=10)
    q_out, k_out = fused_ops.rotary_embedding(torch.empty(0, dtype=torch.int64, device=DEVICE), q, k,
                                              rope.cos_sin_cache, 64)
    assert q_out.shape == (0, 256) and k_out.shape == (0, 128)


# ------------------------------------------------------------------------------------------------- dispatch


def test_cpu_tensors_keep_the_torch_code_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even under TRITON_INTERPRET (which the CPU suite sets), CPU tensors run forward_native unless a test opts in."""
    for module, name in [(layernorm, "rms_norm"), (activation, "silu_and_mul"),
                         (rotary_embedding, "rotary_embedding")]:
        monkeypatch.setattr(module, name, _not_called)
    x = torch.randn(3, 64)
    assert not fused_ops.use_fused_ops(x)
    norm = RMSNorm(64)
    assert torch.equal(norm(x), norm.forward_native(x))
    assert torch.equal(SiluAndMul()(x), SiluAndMul().forward_native(x))
    rope = get_rope(16, 32, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(3)
    assert all(torch.equal(a, b) for a, b in zip(rope(positions, x, x[:, :32]),
                                                 rope.forward_native(positions, x, x[:, :32])))
    assert not fused_ops.use_fused_ops(torch.zeros(3, dtype=torch.float64, device=DEVICE))


@needs_interpreter
@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen3", {"head_dim": 32})])
def test_model_through_the_kernels_matches_hf(kind: str, overrides: dict, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole tiny model with the kernels on (Qwen3: qk_norm on strided head views; Llama: rope on qkv
    slices; v uncopied) gives Hugging Face's logits, and the torch code's."""
    hf_model = make_hf_model(kind, tmp_path, **overrides)
    model_config = ModelConfig(model=str(tmp_path))
    model = get_model(model_config, torch.device("cpu"), torch.float32)
    prompt = torch.randint(0, model_config.vocab_size, (11,), generator=torch.Generator().manual_seed(11)).tolist()
    with torch.no_grad():
        expected = hf_model(torch.tensor([prompt])).logits[0]  # [11, V]

    def run() -> torch.Tensor:
        runner = PagedRunner(model, model_config.num_layers, model_config.num_kv_heads, model_config.head_size)
        return runner.step({"a": prompt}, all_logits=True)

    native = run()
    calls: list[str] = []
    for module, name in [(layernorm, "rms_norm"), (activation, "silu_and_mul"),
                         (rotary_embedding, "rotary_embedding")]:
        def spy(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    monkeypatch.setattr(fused_ops, "INTERPRET_CPU_TENSORS", True)
    fused = run()
    # Per layer: 2 norms, 1 rope, 1 silu_and_mul (+ q_norm, k_norm for Qwen3); plus the final norm.
    per_layer = 6 if kind == "qwen3" else 4
    assert len(calls) == model_config.num_layers * per_layer + 1
    torch.testing.assert_close(fused, expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused, native, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------------- CUDA only


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_sized_shapes_cuda(dtype: torch.dtype) -> None:
    """Qwen2.5-1.5B's shapes at 512 decode rows, compiled on the GPU, against the torch code on the GPU."""
    n, hidden, inter, num_heads, num_kv_heads, head_size = 512, 1536, 8960, 12, 2, 128
    norm = make_norm(hidden, dtype)
    x, residual = randn(n, hidden, dtype=dtype, seed=12), randn(n, hidden, dtype=dtype, seed=13)
    out, residual_out = norm(x, residual)
    native_out, native_residual = norm.forward_native(x, residual)
    assert torch.equal(residual_out, native_residual)
    assert_matches_native(out, native_out)
    assert_matches_native(norm(x), norm.forward_native(x))
    gate_up = randn(n, 2 * inter, dtype=dtype, seed=14, scale=3.0)
    assert_matches_native(SiluAndMul()(gate_up), SiluAndMul().forward_native(gate_up))
    rope = get_rope(head_size, 32768, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    positions = torch.randint(0, 32768, (n,), device=DEVICE)
    q, k, _ = make_qkv(n, num_heads, num_kv_heads, head_size, dtype, seed=15)
    for out, native in zip(rope(positions, q, k), rope.forward_native(positions, q, k)):
        assert_matches_native(out, native)


@needs_cuda
def test_kernels_capture_in_a_cuda_graph() -> None:
    dtype, n = torch.bfloat16, 64
    norm, rope = make_norm(896, dtype), get_rope(64, 1024, {"rope_type": "default", "rope_theta": 1e6}).to(DEVICE)
    x, residual = randn(n, 896, dtype=dtype, seed=16), randn(n, 896, dtype=dtype, seed=17)
    gate_up = randn(n, 2 * 4864, dtype=dtype, seed=18)
    positions = torch.randint(0, 1024, (n,), device=DEVICE)
    q, k, _ = make_qkv(n, 14, 2, 64, dtype, seed=19)

    def step():
        return (*norm(x, residual), SiluAndMul()(gate_up), *rope(positions, q, k))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t, seed in [(x, 20), (residual, 21), (gate_up, 22), (q, 23), (k, 24)]:
        t.copy_(randn(*t.shape, dtype=dtype, seed=seed))
    positions.copy_(torch.randint(0, 1024, (n,), device=DEVICE))
    graph.replay()
    for out, eager in zip(outs, step()):
        assert torch.equal(out, eager)
