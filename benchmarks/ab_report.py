"""The sampling-mask A/B's reporting (benchmarks/ab_sampling_mask.py runs the arms): the arms of several rounds
combined into per-level medians, the markdown table and the throughput plot.

Reads only the result dicts that ab_sampling_mask.run_arm returns (an arm: name, error, levels as
serving_metrics.summarize's); starts nothing.
"""

from __future__ import annotations

import statistics
from typing import Any

import serving_metrics


def _level(arm: dict[str, Any], concurrency: int) -> dict[str, Any] | None:
    for level in arm["levels"]:
        if level.get("concurrency") == concurrency and "output_throughput" in level:
            return level
    return None


def _ratio_value(num: dict[str, Any] | None, den: dict[str, Any] | None,
                 key: str = "output_throughput") -> float | None:
    if num is None or den is None or not den.get(key) or num.get(key) is None:
        return None
    return num[key] / den[key]


def _ratio(num: dict[str, Any] | None, den: dict[str, Any] | None, key: str = "output_throughput") -> str:
    value = _ratio_value(num, den, key)
    return "-" if value is None else f"{value:.3f}"


def combine_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One result per arm (in the first round's order) from the arms' results of every round: each level's
    output throughput, TTFT and TPOT medians are medians over the rounds that have the level (its per-round
    throughputs kept in `round_throughputs`), truncated if any round was, masks_ok if every round's was; an arm
    that failed in any round carries that round's error. An arm
    may be missing from some rounds (ab_sampling_mask.py --arm-rounds): its medians are over the rounds it ran, and
    the arms come in the order of their first appearance."""
    if len(rounds) == 1:
        return rounds[0]
    combined = []
    names = list(dict.fromkeys(a["arm"] for r in rounds for a in r))
    for name in names:
        runs = [a for r in rounds for a in r if a["arm"] == name]
        first = runs[0]
        levels = []
        for level in first["levels"]:
            c = level.get("concurrency")
            got = [lv for lv in (_level(a, c) for a in runs) if lv is not None]
            if not got:
                levels.append(level)
                continue
            merged = dict(got[0])
            for key in ("output_throughput", "steady_output_throughput", "ttft_ms_median", "tpot_ms_median"):
                values = [lv[key] for lv in got if lv.get(key) is not None]
                merged[key] = statistics.median(values) if values else None
            merged["round_throughputs"] = [lv["output_throughput"] for lv in got]
            merged["truncated"] = any(lv["truncated"] for lv in got)
            merged["masks_ok"] = (None if all(lv["masks_ok"] is None for lv in got)
                                  else all(lv["masks_ok"] in (None, True) for lv in got))
            levels.append(merged)
        errors = [a["error"] for a in runs if a["error"]]
        combined.append({"arm": first["arm"], "error": errors[0] if errors else None, "levels": levels,
                         "server_logs": [a["server_log"] for a in runs],
                         "host_loop_ms": [a.get("host_loop_ms") for a in runs]})
    return combined


def _host_speed_lines(rounds: list[list[dict[str, Any]]]) -> list[str]:
    """The host's Python speed before each arm of each round (ab_sampling_mask.host_loop_ms), if recorded."""
    per_round = [", ".join(f"{a['arm']} {a['host_loop_ms']:.1f}" for a in r if a.get("host_loop_ms") is not None)
                 for r in rounds]
    if not any(per_round):
        return []
    lines = ["", "Host speed before each arm (a fixed Python loop, ms, best of three; lower is faster; the `info` "
                 "stage's loop):", ""]
    if len(rounds) == 1:
        return lines + [f"- {per_round[0]}"]
    return lines + [f"- round {i + 1}: {text or '-'}" for i, text in enumerate(per_round)]


def baseline(name: str) -> str:
    """The arm a result's ratio is taken against: no-mask on the same path (ab_sampling_mask.result_name:
    ARM#PATH, or ARM for the streamed path)."""
    _, sep, path = name.rpartition("#")
    return f"no-mask#{path}" if sep and path.isidentifier() else "no-mask"


def markdown(arms: list[dict[str, Any]], concurrencies: list[int],
             rounds: list[list[dict[str, Any]]] | None = None) -> str:
    names = [a["arm"] for a in arms]
    by_name = {a["arm"]: a for a in arms}
    ratio_arms = [n for n in names if n != baseline(n) and baseline(n) in by_name]
    lines = ["Output tokens/s (TTFT median ms / TPOT median ms); * = cut at the level timeout", "",
             "| concurrency | " + " | ".join(names) + " |" + "".join(f" {n} / {baseline(n)} |" for n in ratio_arms),
             "|---:|" + "---:|" * (len(names) + len(ratio_arms))]
    for c in concurrencies:
        cells = []
        for a in arms:
            lv = _level(a, c)
            if lv is None:
                cells.append("failed" if a["error"] else "-")
                continue
            flag = "*" if lv["truncated"] else ""
            bad = "" if lv["masks_ok"] in (None, True) else " MASKS BAD"
            ttft = serving_metrics._fmt(lv["ttft_ms_median"], 0)
            tpot = serving_metrics._fmt(lv["tpot_ms_median"], 1)
            cells.append(f"{lv['output_throughput']:.0f}{flag} ({ttft} / {tpot}){bad}")
        ratios = "".join(f" {_ratio(_level(by_name[n], c), _level(by_name[baseline(n)], c))} |" for n in ratio_arms)
        lines.append(f"| {c} | " + " | ".join(cells) + " |" + ratios)
    if any(lv.get("steady_output_throughput") is not None for a in arms for lv in a["levels"]):
        lines += ["", "Steady state: output tokens/s in the middle 60% of each level (its ramp-up and drain left out):",
                  "", "| concurrency | " + " | ".join(names) + " |"
                  + "".join(f" {n} / {baseline(n)} |" for n in ratio_arms),
                  "|---:|" + "---:|" * (len(names) + len(ratio_arms))]
        for c in concurrencies:
            cells = []
            for a in arms:
                lv = _level(a, c)
                value = None if lv is None else lv.get("steady_output_throughput")
                cells.append("-" if value is None else f"{value:.0f}")
            ratios = "".join(f" {_ratio(_level(by_name[n], c), _level(by_name[baseline(n)], c), key)} |"
                             for n in ratio_arms for key in ("steady_output_throughput",))
            lines.append(f"| {c} | " + " | ".join(cells) + " |" + ratios)
    if rounds is not None and len(rounds) > 1 and ratio_arms:
        fewer = [f"{n} in {sum(n in {a['arm'] for a in r} for r in rounds)}" for n in names
                 if any(n not in {a["arm"] for a in r} for r in rounds)]
        lines += ["", f"Medians over {len(rounds)} rounds" + (f" ({', '.join(fewer)} of them)" if fewer else "")
                  + " (arm order alternating between rounds); each round's own ratios, then in brackets the median "
                    "of those (the arms of one round ran back to back, so this pairs them; the table divides the "
                    "medians):", ""]
        for c in concurrencies:
            per_round = []
            paired: dict[str, list[float]] = {n: [] for n in ratio_arms}
            for r in rounds:
                by = {a["arm"]: a for a in r}

                def base(n: str, by: dict = by) -> dict[str, Any] | None:
                    return _level(by[baseline(n)], c) if baseline(n) in by else None

                per_round.append(" ".join(_ratio(_level(by[n], c), base(n)) if n in by else "-" for n in ratio_arms))
                for n in ratio_arms:
                    value = _ratio_value(_level(by[n], c), base(n)) if n in by else None
                    if value is not None:
                        paired[n].append(value)
            medians = " ".join(f"{statistics.median(v):.3f}" if v else "-" for v in paired.values())
            lines.append(f"- c={c}: " + ", ".join(per_round) + f" [{medians}]")
    lines += _host_speed_lines(rounds if rounds is not None and len(rounds) > 1 else [arms])
    for a in arms:
        if a["error"]:
            lines.append(f"\n{a['arm']} failed: {a['error']}")
    return "\n".join(lines)


def plot(arms: list[dict[str, Any]], concurrencies: list[int], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in arms:
        points = [(lv["concurrency"], lv["output_throughput"]) for lv in a["levels"] if "output_throughput" in lv]
        if points:
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=a["arm"])
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
