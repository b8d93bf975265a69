"""benchmarks/ab_report.py: the engine core's step-timing and GC log lines read from a server log, the rounds
combined into medians, and the markdown table."""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import ab_report as report  # noqa: E402

# Two lines as the engine core writes them (from an H200 run), between other log lines.
LOG = """INFO 2026-12-03 07:17:20,001 vllm.v1.worker.worker: KV cache: 32767 blocks of 16 tokens (1.00 GiB)
INFO 2026-12-03 07:18:01,000 vllm.v1.engine.core_proc: Engine step timing: 177.1 steps/s, 63 rows/step, ms/step: \
inputs 0.02 schedule 0.07 launch 3.01 wait 2.25 update 0.12 send 0.17 out.event 5.41 out.lists 0.02; host busy 60%
INFO:     127.0.0.1:33396 - "POST /v1/completions HTTP/1.1" 200 OK
INFO 2026-12-03 07:18:05,000 vllm.v1.engine.core_proc: Engine step timing: 62.8 steps/s, 947 rows/step, ms/step: \
inputs 0.02 schedule 0.87 launch 3.78 wait 8.85 update 1.82 send 0.47 out.event 14.31 out.lists 0.93; host busy 44%
"""


def test_step_timing_windows_are_parsed_and_the_busiest_is_tabled(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "server_mask.log"
    path.write_text(LOG)
    windows = report.parse_step_timing(str(path))
    assert len(windows) == 2
    assert windows[0] == {"steps_per_s": 177.1, "rows": 63.0, "host_busy_pct": 60.0, "inputs": 0.02,
                          "schedule": 0.07, "launch": 3.01, "wait": 2.25, "update": 0.12, "send": 0.17,
                          "out.event": 5.41, "out.lists": 0.02}
    assert windows[1]["rows"] == 947 and windows[1]["wait"] == 8.85
    assert report.parse_step_timing(str(tmp_path / "missing.log")) == []

    arm = {"arm": "mask", "error": None, "levels": [], "step_timing": windows}
    text = report.markdown([arm], [64])
    # Neither launch.mask nor the device phases in this log.
    assert "| mask | 947 | 62.8 | 0.87 | 3.78 | - | 8.85 | 1.82 | 0.47 | 0.93 | - | - | 44% |" in text
    windows[1]["launch.mask"] = 0.63  # the runner's split of launch (newer logs), when present
    windows[1].update({"dev.step": 11.2, "dev.gap": 1.37})  # CUDA with step timing (newer logs)
    assert "| mask | 947 | 62.8 | 0.87 | 3.78 | 0.63 | 8.85 | 1.82 | 0.47 | 0.93 | 11.20 | 1.37 | 44% |" in \
        report.markdown([arm], [64])
    assert "step timing" not in report.markdown([{**arm, "step_timing": []}], [64])


def _arm(name: str, throughputs: dict[int, float], error: str | None = None) -> dict:
    levels = [{"concurrency": c, "output_throughput": t, "steady_output_throughput": t + 10,
               "ttft_ms_median": t / 100, "tpot_ms_median": 1.0,
               "truncated": c == 8 and name == "mask", "masks_ok": True if name == "mask" else None}
              for c, t in throughputs.items()]
    return {"arm": name, "error": error, "levels": levels, "step_timing": [], "server_log": f"{name}.log"}


def test_rounds_are_combined_into_medians_with_each_rounds_ratios() -> None:
    rounds = [[_arm("no-mask", {4: 100.0, 8: 200.0}), _arm("mask", {4: 90.0, 8: 150.0})],
              [_arm("no-mask", {4: 110.0, 8: 180.0}), _arm("mask", {4: 100.0, 8: 190.0})],
              [_arm("no-mask", {4: 120.0, 8: 220.0}), _arm("mask", {4: 80.0, 8: 170.0}, error="boom")]]
    arms = report.combine_rounds(rounds)
    assert [a["arm"] for a in arms] == ["no-mask", "mask"]
    mask_4 = report._level(arms[1], 4)
    assert mask_4["output_throughput"] == 90.0 and mask_4["round_throughputs"] == [90.0, 100.0, 80.0]
    assert mask_4["ttft_ms_median"] == 0.9 and not mask_4["truncated"] and mask_4["masks_ok"] is True
    assert report._level(arms[1], 8)["truncated"] and report._level(arms[0], 8)["output_throughput"] == 200.0
    assert arms[1]["error"] == "boom" and arms[0]["error"] is None
    table = report.markdown(arms, [4, 8], rounds)
    # The table's ratio is the ratio of the medians (90 / 110, 170 / 200); each round's own ratio follows.
    assert "| 0.818 |" in table and "| 0.850 |" in table
    assert "- c=4: 0.900, 0.909, 0.667 [0.900]" in table and "- c=8: 0.750, 1.056, 0.773 [0.773]" in table
    # Steady-state medians (throughput + 10 here): no mask 120 and mask 100 at c=4.
    assert "Steady state" in table and "| 4 | 120 | 100 | 0.833 |" in table
    assert report.combine_rounds(rounds[:1]) is rounds[0]
    assert "Host speed" not in table  # none recorded


def test_host_speed_before_each_arm_is_listed_per_round() -> None:
    """ab_sampling_mask.run_arm records the host's Python loop time before each arm: the report lists it per round
    (a round on a slower host then reads as such), or once for a single round."""
    rounds = [[{**_arm("no-mask", {4: 100.0}), "host_loop_ms": 43.04},
               {**_arm("mask", {4: 90.0}), "host_loop_ms": 84.3}],
              [{**_arm("no-mask", {4: 110.0}), "host_loop_ms": 44.0}, _arm("mask", {4: 100.0})]]
    arms = report.combine_rounds(rounds)
    assert arms[1]["host_loop_ms"] == [84.3, None]
    table = report.markdown(arms, [4], rounds)
    assert "- round 1: no-mask 43.0, mask 84.3\n- round 2: no-mask 44.0" in table
    single = report.markdown(rounds[0], [4])
    assert "Host speed before each arm" in single and "- no-mask 43.0, mask 84.3" in single


def test_gc_pause_windows_are_parsed_and_tabled(tmp_path) -> None:  # noqa: ANN001
    """The API servers' and the engine core's GC lines (two H200 lines and one of the engine core's format) are read
    and tabled per arm as the largest paused share and the longest pause; without them there is no table."""
    path = tmp_path / "server_mask.log"
    path.write_text(
        "INFO 2026-12-03 14:49:45,658 vllm.entrypoints.openai.api_server: API server 6682 GC: gen0 1375 (205.9 ms) "
        "gen1 125 (172.8 ms) gen2 11 (693.0 ms); paused 21.4% of 5.0 s, longest 97.4 ms\n"
        "INFO 2026-12-03 14:49:45,720 vllm.entrypoints.openai.api_server: API server 6680 GC: gen0 1413 (202.1 ms) "
        "gen1 128 (201.2 ms) gen2 12 (959.0 ms); paused 27.2% of 5.0 s, longest 121.4 ms\n"
        "INFO 2026-12-03 14:49:46,000 vllm.v1.engine.core_proc: Engine core GC: gen0 90 (9.0 ms) gen1 8 (4.1 ms) "
        "gen2 1 (12.5 ms); paused 0.5% of 5.0 s, longest 12.5 ms\n")
    windows = report.parse_gc_pauses(str(path))
    assert [w["who"] for w in windows] == ["API server 6682", "API server 6680", "Engine core"]
    assert windows[1] == {"who": "API server 6680", "paused_pct": 27.2, "window_s": 5.0, "longest_ms": 121.4}
    assert report.parse_gc_pauses(str(tmp_path / "missing.log")) == []
    arm = {"arm": "mask", "error": None, "levels": [], "gc": windows}
    assert "| mask | 27.2% (121 ms) | 0.5% (12 ms) |" in report.markdown([arm], [64])
    assert "| mask | 27.2% (121 ms) | - |" in report.markdown([{**arm, "gc": windows[:2]}], [64])
    assert "Garbage collection" not in report.markdown([{**arm, "gc": []}], [64])


def test_steady_windows_average_the_full_batch_windows() -> None:
    """steady_windows: the windows with 0.96-1.0 x the streams in rows per step, averaged (host = the main
    thread's five phases); ramp-up, drain and other levels' windows left out; tabled by markdown."""
    def window(rows: float, sps: float, launch: float, gap: float | None = None) -> dict:
        w = {"steps_per_s": sps, "rows": rows, "host_busy_pct": 50.0, "inputs": 0.1, "schedule": 0.2,
             "launch": launch, "update": 0.5, "send": 0.4, "out.lists": 0.3, "dev.step": 4.5}
        if gap is not None:
            w["dev.gap"] = gap
        return w

    windows = [window(137, 30.0, 20.0), window(251, 218.0, 1.2, 0.1), window(253, 222.0, 1.4, 0.3),
               window(193, 240.0, 1.0), window(505, 140.0, 1.6), window(0, 0.0, 0.0)]
    arm = {"arm": "mask", "error": None, "levels": [], "step_timing": windows}
    got = report.steady_windows(arm, 256)
    assert got is not None and got["windows"] == 2
    assert got["steps_per_s"] == 220.0 and abs(got["launch"] - 1.3) < 1e-9
    assert abs(got["host"] - (0.1 + 0.2 + 1.3 + 0.5 + 0.4)) < 1e-9 and abs(got["dev.gap"] - 0.2) < 1e-9
    assert report.steady_windows(arm, 512)["windows"] == 1 and "dev.gap" not in report.steady_windows(arm, 512)
    assert report.steady_windows(arm, 1024) is None
    text = report.markdown([arm], [256, 512, 1024])
    assert "| 256 | mask | 2 | 220.0 | 2.50 | 1.30 | 0.50 | 0.40 | 0.30 | 4.50 | 0.20 |" in text
    assert "| 512 | mask | 1 | 140.0 | 2.80 | 1.60 | 0.50 | 0.40 | 0.30 | 4.50 | - |" in text
    assert "| 1024 | mask |" not in text
