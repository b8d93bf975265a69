"""Per-thread CPU use of this machine's python processes, sampled every --interval s (for serving profiles).

Prints, per interval, the busiest threads: CPU % of one core, of it the kernel's (system time: syscalls such
as socket writes, page faults), the % of the interval it waited for a CPU while runnable (the kernel's schedstat: run queue delay, i.e. CPU contention, which GIL waits are not), pid, thread
name, and the process's arguments; and for the whole machine the share of its CPU time stolen by the hypervisor
(/proc/stat "steal": a VM's vCPUs waiting for physical ones, which slows every thread alike) and the mean clock
of its CPUs (/proc/cpuinfo), the two outside causes of a level whose host work runs slower. Runs until killed. Used by tools/gpu_run.sh (CPU_SAMPLE=1) next to a benchmark.
"""

from __future__ import annotations

import argparse
import os
import time


def snapshot() -> dict[tuple[int, int], tuple[int, int, str, str, int]]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            if "python" not in cmd:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    stat = f.read()
                name = stat[stat.index("(") + 1:stat.rindex(")")]
                fields = stat[stat.rindex(")") + 2:].split()
                try:
                    with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                        runq_ns = int(f.read().split()[1])
                except (OSError, IndexError, ValueError):
                    runq_ns = 0
                out[(int(pid), int(tid))] = (int(fields[11]) + int(fields[12]), int(fields[12]), name, cmd, runq_ns)
        except (OSError, ValueError):
            continue
    return out


def machine_ticks() -> tuple[int, int]:
    """(all CPU ticks, stolen ticks) of the whole machine since boot (/proc/stat's "cpu" line)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # NOTE: guest and guest_nice (fields 9-10) are already counted in user and nice.
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0


def mean_mhz() -> float | None:
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(line.split(":")[1]) for line in f if line.startswith("cpu MHz")]
    except (OSError, ValueError, IndexError):
        return None
    return sum(mhz) / len(mhz) if mhz else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--interval", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    hz = os.sysconf("SC_CLK_TCK")
    prev, t_prev, ticks_prev = snapshot(), time.monotonic(), machine_ticks()
    while True:
        time.sleep(args.interval)
        cur, t_cur, ticks_cur = snapshot(), time.monotonic(), machine_ticks()
        all_ticks, stolen = ticks_cur[0] - ticks_prev[0], ticks_cur[1] - ticks_prev[1]
        steal = 100.0 * stolen / all_ticks if all_ticks > 0 else 0.0
        mhz = mean_mhz()
        rows = []
        for key, (ticks, sys_ticks, name, cmd, runq_ns) in cur.items():
            if key in prev:
                pct = 100.0 * (ticks - prev[key][0]) / hz / (t_cur - t_prev)
                sys_pct = 100.0 * (sys_ticks - prev[key][1]) / hz / (t_cur - t_prev)
                runq = 100.0 * (runq_ns - prev[key][4]) / 1e9 / (t_cur - t_prev)
                if pct >= 1.0:
                    rows.append((pct, sys_pct, runq, key[0], name, cmd))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        clock = f", {mhz:.0f} MHz" if mhz is not None else ""
        print(f"--- {time.strftime('%H:%M:%S')} total {total:.0f}% of one core (cpu%, of it sys%, runq wait%); "
              f"machine: {steal:.1f}% stolen{clock}", flush=True)
        for pct, sys_pct, runq, pid, name, cmd in rows[:args.top]:
            print(f"{pct:6.1f}% {sys_pct:5.1f}% {runq:5.1f}% {pid:>7} {name:<16} {cmd[:100]}", flush=True)
        prev, t_prev, ticks_prev = cur, t_cur, ticks_cur


if __name__ == "__main__":
    main()
