"""tools/profiling/prefilter_overflow.py: the gathered count of a hand-worked row, the buffer size, and the script on
the bundled tiny checkpoint (its counts against the prefilter select's own, run under the Triton interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "profiling"))
import prefilter_overflow as po  # noqa: E402

INF = float("inf")


def test_gathered_count_of_a_hand_worked_row() -> None:
    # Chunks of 2: [1, 9] [3, 2] [8, -inf] [4, 4]; maxima 9, 3, 8, 4. k = 2: t0 = 8, gathered {9, 8} -> 2.
    # k = 3: t0 = 4 -> {9, 8, 4, 4} -> 4. k = 5 > 4 chunks: t0 = -inf -> every finite value, 7.
    row = torch.tensor([[1.0, 9.0, 3.0, 2.0, 8.0, -INF, 4.0, 4.0]])
    assert [int(po.gathered_counts(row, 1.0, k, chunk=2)) for k in (2, 3, 5)] == [2, 4, 7]
    # Temperature divides before the bound: 0.5 doubles every z, the same sets.
    assert int(po.gathered_counts(row, 0.5, 3, chunk=2)) == 4
    # A last partial chunk (V = 7, S = 2): [1, 9] [3, 2] [8, -inf] [4]; k = 4 -> t0 = 3 -> {9, 3, 8, 4} -> 4.
    assert int(po.gathered_counts(row[:, :7], 1.0, 4, chunk=2)) == 4


def test_buffer_cap_is_the_selects() -> None:
    # C = k + max(64, k // 4) (fast_path.num_candidates); cap = max(2048, 2C).
    assert po.buffer_cap(512, 151936) == 2048  # C = 640
    assert po.buffer_cap(2048, 151936) == 2 * (2048 + 512)


def test_script_on_the_tiny_checkpoint_matches_the_prefilter_kernels(tmp_path) -> None:  # noqa: ANN001
    model = os.path.join(REPO_ROOT, "vllm", "assets", "tiny-llama")
    out = tmp_path / "overflow.json"
    proc = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "profiling", "prefilter_overflow.py"),
                           "--model", model, "--top-k", "8", "64", "--max-tokens", "24", "--device", "cpu",
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    results = json.loads(out.read_text())["results"]
    assert set(results) == {"8", "64"} and all(r["positions"] > 0 for r in results.values())
    assert "| 64 |" in proc.stdout
    # The counts against the kernels': the prefilter's gathered count is what its select calls num_above; the
    # rows it does not flag as overflow must be those with count <= cap (here: cap = 2048 > V = 4096 / 2).
    # NOTE: the kernels on the GPU where there is one, else interpreted (tests/conftest.py sets TRITON_INTERPRET
    # without CUDA); never set here: left in the environment, it sent later tests' CPU tensors into compiled kernels.
    from vllm.v1.sample.ops.topk_select import select_top_k_candidates

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = (torch.randn(6, 4096) * 3).to(torch.bfloat16).float()
    top_k = torch.tensor([8, 64, 64, 8, 300, 1], dtype=torch.int32)
    got = select_top_k_candidates(logits.to(device), torch.ones(6, device=device), top_k.to(device), 380,
                                  use_triton=True)
    for r, k in enumerate(top_k.tolist()):
        gathered = int(po.gathered_counts(logits[r:r + 1], 1.0, k))
        kth = float(got.kth[r])
        # Every value >= the row's kth was gathered (t0 <= kth), and at least k values were.
        assert gathered >= k and gathered >= int((logits[r] >= kth).sum())
