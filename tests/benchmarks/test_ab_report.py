"""benchmarks/ab_report.py: the rounds combined into medians, and the markdown table."""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import ab_report as report  # noqa: E402

def _arm(name: str, throughputs: dict[int, float], error: str | None = None) -> dict:
    levels = [{"concurrency": c, "output_throughput": t, "steady_output_throughput": t + 10,
               "ttft_ms_median": t / 100, "tpot_ms_median": 1.0,
               "truncated": c == 8 and name == "mask", "masks_ok": True if name == "mask" else None}
              for c, t in throughputs.items()]
    return {"arm": name, "error": error, "levels": levels, "server_log": f"{name}.log"}


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


def test_each_path_is_compared_with_no_mask_on_the_same_path() -> None:
    """Columns ARM#PATH (ab_sampling_mask.result_name) take their ratio against no-mask#PATH, the streamed ARM
    against no-mask (hand-worked: 90 / 100 streamed, 99 / 110 generate, 54 / 60 offline)."""
    arms = [_arm("no-mask", {4: 100.0}), _arm("mask", {4: 90.0}), _arm("no-mask#generate", {4: 110.0}),
            _arm("mask#generate", {4: 99.0}), _arm("no-mask#offline", {4: 60.0}), _arm("mask#offline", {4: 54.0})]
    assert report.baseline("mask#generate") == "no-mask#generate" and report.baseline("mask") == "no-mask"
    table = report.markdown(arms, [4])
    header = table.splitlines()[2]
    assert header.endswith("| mask / no-mask | mask#generate / no-mask#generate | mask#offline / no-mask#offline |")
    assert table.splitlines()[4].endswith("| 0.900 | 0.900 | 0.900 |")
