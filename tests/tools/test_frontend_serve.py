"""tools/profiling/frontend_serve.py: the replay engine core's step outputs (checked against the ids it drew,
parsed back from the JSON text), its device pacing, the py-spy stack summary on a hand-worked profile, and one
short run of the whole harness: `vllm serve` with the replay core, the load generator, and the CPU read per process."""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "profiling"))
import frontend_serve  # noqa: E402
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402


def _core(device_ms: float = 0.0, mask_size: int = 5):
    config = VllmConfig(model_config=ModelConfig(model=frontend_serve.MODEL_DIR, max_model_len=64,
                                                 logprobs_mode="processed_logprobs", return_sampling_mask=True),
                        cache_config=CacheConfig(block_size=16),
                        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    config.model_config.sampling_mask_text = True
    return frontend_serve.replay_core(config, device_ms=device_ms, device_ms_per_row=0.0, mask_size=mask_size)


def test_replay_worker_outputs_a_step_as_the_device_would() -> None:
    core = _core()
    params = SamplingParams(temperature=1.0, top_k=512, logprobs=1, max_tokens=4, ignore_eos=True,
                            return_sampling_mask=True)
    # Clients 0, 1, 0: the text packs client 0's rows first (rows 0 and 2), then client 1's.
    for i, client in enumerate((0, 1, 0)):
        core.scheduler.add_request(Request(f"r{i}", [3, 4, 5, 6], params, None, client_index=client))
    sched_out = core.scheduler.schedule()
    out = core.worker.execute_model(sched_out)
    assert out.req_ids == ["r0", "r1", "r2"] and [len(t) for t in out.sampled_token_ids] == [1, 1, 1]
    vocab = core.vllm_config.model_config.vocab_size
    tokens = [t[0] for t in out.sampled_token_ids]
    assert all(3 <= t < vocab for t in tokens)
    # logprobs=1: the sampled token and one more per row, the sampled one first.
    assert out.logprobs.logprob_token_ids.shape == (3, 2)
    assert out.logprobs.logprob_token_ids[:, 0].tolist() == tokens
    np.testing.assert_array_equal(out.sampling_mask_text.rank, [0, 2, 1])
    assert out.sampling_masks.token_ids is None  # the ids stay on the device; sizes only
    np.testing.assert_array_equal(np.diff(out.sampling_masks.offsets), [5, 5, 5])
    text, offsets = out.sampling_mask_text.text.tobytes(), out.sampling_mask_text.offsets
    rows = [json.loads(text[offsets[k]:offsets[k + 1]]) for k in range(3)]
    drawn = core.worker.mask_ids[:5].tolist()
    assert rows == [drawn] * 3 and drawn == sorted(set(drawn)) and all(0 <= t < vocab for t in drawn)
    # The real scheduler takes the output: each request got its token.
    outputs = core.scheduler.update_from_output(sched_out, out).outputs
    assert [o.new_token_ids for o in outputs] == [[t] for t in tokens]


def test_replay_steps_are_paced_like_a_device() -> None:
    core = _core(device_ms=20.0)
    core.scheduler.add_request(Request("r0", [3, 4], SamplingParams(max_tokens=8, ignore_eos=True), None))
    t0 = time.perf_counter()
    for _ in range(3):
        core.step()
    # Three steps of a device that needs 20 ms each, however fast the host.
    assert time.perf_counter() - t0 >= 0.06


def test_stack_summary_of_a_hand_worked_profile(tmp_path) -> None:
    path = tmp_path / "p.txt"
    path.write_text("main (a.py:1);work (a.py:5) 3\nmain (a.py:1);wait (a.py:9) 1\n")
    rows = frontend_serve.stack_summary(str(path)).splitlines()
    assert rows[0].startswith("4 samples")
    assert rows[1].split() == ["75.00", "75.00", "work", "(a.py:5)"]
    assert rows[2].split() == ["25.00", "25.00", "wait", "(a.py:9)"]
    assert rows[4].split() == ["100.00", "main", "(a.py:1)"]


def test_one_short_run_measures_the_api_server(tmp_path) -> None:
    out = tmp_path / "r.json"
    code = frontend_serve.main(["--arms", "mask", "--concurrency", "2", "--duration", "3", "--warmup-s", "2",
                                "--max-num-seqs", "8", "--input-len", "8", "--output-len", "12", "--mask-size", "7",
                                "--device-ms", "2", "--out-dir", str(tmp_path), "--json-out", str(out)])
    result = json.loads(out.read_text())["results"][0]
    assert code == 0, result
    assert result["error"] is None and result["summary"]["output_tokens"] > 0
    # Every streamed token came with its mask, of the replay's size (counted by the client from the JSON).
    assert result["summary"]["masks_ok"] is True and result["summary"]["mean_mask_size"] == 7
    roles = sorted(p["role"] for p in result["procs"])
    assert roles == ["API server", "engine core"]
    assert result["api_us_per_token"] > 0
