"""tools/profiling/penalty_step.py on CPU: both arms run on one engine, the penalties arm (and only it) takes the
penalty path each step (state slots at admission, count_sampled after the sampler), the engine's module-level
functions are put back afterwards, and the model-free host operations count each sampled token."""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "profiling"))
import penalty_step  # noqa: E402

from vllm.v1.sample import fast_path, sampler  # noqa: E402
from vllm.v1.sample.ops import topk_select  # noqa: E402
from vllm.v1.worker import async_output, model_runner, penalty_state  # noqa: E402


def test_arms_take_their_paths(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    get_output = async_output.AsyncModelRunnerOutput.get_output
    results = penalty_step.main(["--device", "cpu", "--rows", "3", "--steps", "2", "--settle", "1", "--input-len",
                                 "8", "--cpu-layers", "1", "--cpu-hidden", "32", "--rounds", "2"])
    assert [(r["arm"], r["round"]) for r in results] == [("plain", 1), ("penalties", 1), ("penalties", 2),
                                                         ("plain", 2)]
    for r in results:
        calls = r["calls_per_step"]
        for phase in ("schedule", "prepare", "metadata", "penalty fields", "forward", "sampler", "update"):
            assert calls[phase] == 1.0, (r["arm"], phase)
        penalised = r["arm"] == "penalties"
        assert calls.get("count", 0.0) == (1.0 if penalised else 0.0)
        # Each penalised request takes a slot when it is first scheduled; plain requests take none.
        assert r["admission_requests"] == (3 if penalised else 0)
        assert r["host"]["step"] > 0 and r["host"]["sampler"] > 0
        # The model's bf16 logits go to the top-k select as they are; with penalties, the kernel's float32 copy.
        assert r["select_reads"] == (["float32"] if penalised else ["bfloat16"])
    # The pool is made on the first penalised request with min(64, max_num_seqs) = 3 slots, and never grows.
    assert results[1]["one_time"] == [e for e in results[1]["one_time"] if e.startswith("pool -> 3 slots x 16")]
    assert len(results[1]["one_time"]) == 1 and results[2]["one_time"] == []
    assert results[0]["penalty_pool"]["slots"] == 0 and results[3]["penalty_pool"]["slots"] == 3
    assert model_runner.count_sampled is sampler.count_sampled
    assert model_runner.step_penalty_fields is penalty_state.step_penalty_fields
    assert async_output.AsyncModelRunnerOutput.get_output is get_output
    assert fast_path.select_top_k_candidates is topk_select.select_top_k_candidates


def test_host_ops_count_each_token() -> None:
    """--host-ops raises unless update_state counted each row's token once per call (checked inside)."""
    (r,) = penalty_step.main(["--device", "cpu", "--host-ops", "8", "--steps", "20", "--input-len", "16"])
    assert r["rows"] == 8 and r["penalties penalty fields us"] > 0 and r["update_state us"] > 0
    assert "aten::index_put_" in r["update_state ops"]
