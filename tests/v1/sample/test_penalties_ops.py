"""ops/penalties.py: the penalty kernel against its torch code (bitwise, under TRITON_INTERPRET on CPU), both
against a float64 numpy reference of vLLM's definitions, and the sparse ops on hand-worked cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm.v1.sample.ops.penalties import (PROMPT_BIT, apply_allowed, apply_bad_word_prefixes, apply_penalties,
                                          apply_sparse_bias, update_state)

V = 200


def random_state(rng: np.random.Generator, num_slots: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    counts = rng.integers(0, 4, (num_slots, V)) * (rng.random((num_slots, V)) < 0.1)
    prompt = rng.random((num_slots, V)) < 0.1
    counts[-1] = 0  # the scratch slot
    prompt[-1] = False
    state = torch.from_numpy((counts + PROMPT_BIT * prompt).astype(np.int32))
    return state, counts, prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_torch_and_numpy(dtype: torch.dtype) -> None:
    rng = np.random.default_rng(0)
    n = 9
    state, counts, prompt = random_state(rng, 6)
    slot = torch.tensor([0, 1, 2, 3, 4, 5, 5, 0, 1], dtype=torch.int64)
    logits = torch.from_numpy(rng.standard_normal((n, V)).astype(np.float32) * 4).to(dtype)
    logits[0, :5] = 0.0
    logits[1, :3] = float("-inf")
    rep = torch.tensor(rng.uniform(0.5, 2.0, n), dtype=torch.float32)
    freq = torch.tensor(rng.uniform(-2, 2, n), dtype=torch.float32)
    pres = torch.tensor(rng.uniform(-2, 2, n), dtype=torch.float32)
    rep[6], freq[6], pres[6] = 1.0, 0.0, 0.0  # a neutral row on the scratch slot: unchanged
    outs = []
    # NOTE: the kernel on CUDA tensors where there is a GPU (a compiled kernel cannot read CPU tensors), else
    # interpreted on the CPU.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for use_triton in (False, True):
        args = [t.to(dev) if use_triton else t for t in (logits, state, slot, rep, freq, pres)]
        out = torch.empty((n, V), dtype=torch.float32, device=args[0].device)
        outs.append(apply_penalties(*args, out=out, use_triton=use_triton).cpu())
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][6], logits[6].float())
    x = logits.double().numpy()
    c = counts[slot.numpy()].astype(np.float64)
    seen = prompt[slot.numpy()] | (c > 0)
    r, f, p = (t.double().numpy()[:, None] for t in (rep, freq, pres))
    want = np.where(seen, np.where(x > 0, x / r, x * r), x) - f * c - p * (c > 0)
    got = outs[0].double().numpy()
    assert np.array_equal(np.isneginf(got), np.isneginf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=1e-5)


def test_sparse_ops_hand_worked() -> None:
    logits = torch.zeros((2, 6))
    apply_sparse_bias(logits, torch.tensor([0, 1, 1, 0, 5]), torch.tensor([2, 3, 3, 0, 1]),
                      torch.tensor([1.5, -2.0, float("-inf"), 0.0, 9.0]))  # row 5 is past the batch: ignored
    assert logits.tolist() == [[0, 0, 1.5, 0, 0, 0], [0, 0, 0, float("-inf"), 0, 0]]
    logits = torch.zeros((3, 6))
    # Row 1 restricted to {2, 4}; (0, V + 1) is padding; row 7 is past the batch.
    apply_allowed(logits, torch.tensor([1, 1, 1, 0, 7]), torch.tensor([6, 2, 4, 7, 6]))
    assert torch.isfinite(logits).tolist() == [[True] * 6, [False, False, True, False, True, False], [True] * 6]
    recent = torch.tensor([[-1, 5, 9], [-1, -1, -1]], dtype=torch.int32)  # slot 0 last tokens ... 5, 9
    slot = torch.tensor([0, 1])
    logits = torch.zeros((2, 12))
    prefixes = torch.tensor([[-2, 5, 9], [-2, -2, 9], [-2, -2, 5], [-2, -2, 9], [4, 5, 9]])
    apply_bad_word_prefixes(logits, recent, slot, torch.tensor([0, 0, 0, 1, 0]), prefixes,
                            torch.tensor([1, 2, 3, 4, 10]))
    # [5, 9] and [9] match row 0's tail; [5] does not; row 1 has no output; [4, 5, 9] is longer than the tail.
    assert torch.isneginf(logits).nonzero().tolist() == [[0, 1], [0, 2]]


def test_update_state_counts_only_weighted_rows() -> None:
    state = torch.zeros((3, 8), dtype=torch.int32)
    state[0, 4] = PROMPT_BIT
    recent = torch.full((3, 2), -1, dtype=torch.int32)
    update_state(state, recent, torch.tensor([0, 2, 2]), torch.tensor([1, 0, 0], dtype=torch.int32),
                 torch.tensor([4, 6, 7]))
    assert state[0, 4].item() == PROMPT_BIT + 1 and int(state[1:].abs().sum()) == 0
    assert recent.tolist() == [[-1, 4], [-1, -1], [-1, -1]]
