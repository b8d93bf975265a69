"""The in-process frontend's sampling-mask host work per step, and the memory it keeps alive: N requests'
MaskAccumulators fed one id row per request per step as the output processor feeds them, each row a view of its
step's int32 array, which comes as the in-process engine on CUDA hands it over (vllm/v1/worker/async_output.py):
in a lending staging slot that no view keeps in use (up to _MAX_LENDING_SLOTS), else copied out of the step's slot
into fresh memory. No device, no model: the accumulators, the step arrays and the hand-overs only.

    python tools/profiling/mask_retention.py [--num-reqs 1024] [--steps 256] [--mask-size 500] \
        [--lengths LO HI] [--trees /tmp/old .] [--rounds 3]

Two shapes of load:
- a batch (the default, `LLM.generate`): every request runs `--steps` tokens, then all are handed over and their
  `ids` read, and kept (as LLM.generate returns them);
- `--lengths LO HI` (a long-running AsyncLLM / LLM): each request runs LO..HI tokens (uniform), then is handed over,
  its `ids` read and dropped, and a new request takes its place; `--steps` steps.

Per run (each in a fresh process, trees alternating over `--rounds`; the median per tree): ms of CPU per step, all
of it and its parts (the step's copy out of its slot when no lending slot is free, the appends, the hand-overs with
`ids` spread over the steps), the step arrays alive at the end, the peak RSS, and the minor page faults (4 KB of
fresh memory touched the first time each: on the development machine most of the cost of any copy into memory not
used before).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
import weakref

import numpy as np


def run(num_reqs: int, steps: int, mask_size: int, lengths: tuple[int, int] | None) -> dict[str, float]:
    import gc

    import torch

    from vllm.v1.engine.mask_accumulator import MaskAccumulator
    from vllm.v1.host_staging import HostStagingSlot
    from vllm.v1.outputs import SamplingMaskLists
    from vllm.v1.worker.async_output import _MAX_LENDING_SLOTS

    rng = np.random.default_rng(0)
    sizes = rng.integers(mask_size // 2, mask_size * 3 // 2 + 1, num_reqs)
    offsets = np.zeros(num_reqs + 1, np.int64)
    offsets[1:] = np.cumsum(sizes)
    bounds = offsets.tolist()
    # One step's ids (the same every step: what they are does not change the cost).
    template = rng.integers(0, 151_936, int(offsets[-1]), dtype=np.int32)
    source = torch.from_numpy(template)

    def new_length() -> int:
        return steps if lengths is None else int(rng.integers(lengths[0], lengths[1] + 1))

    accs = [MaskAccumulator(str(i)) for i in range(num_reqs)]
    num_done = [0] * num_reqs
    remaining = [new_length() for _ in range(num_reqs)]
    alive: list[weakref.ref] = []
    slots: list[HostStagingSlot] = []
    cpu = {"copy": 0.0, "append": 0.0, "finish": 0.0}
    faults = {"copy": 0, "append": 0, "finish": 0}
    num_copied_out = num_finished = 0
    for _ in range(steps):
        t0, f0 = time.process_time(), _minor_faults()
        slot = next((s for s in slots if not s.in_use()), None)
        if slot is None and len(slots) < _MAX_LENDING_SLOTS:
            slots.append(HostStagingSlot(pin=False, lends=True))
            slot = slots[-1]
        if slot is not None:
            cpu["copy"] += time.process_time() - t0
            step_ids = slot.array("ids", slot.copy(source, "ids"))  # NOTE: untimed: the device's DMA on CUDA
        else:
            step_ids = template.copy()
            cpu["copy"] += time.process_time() - t0
            faults["copy"] += _minor_faults() - f0
            num_copied_out += 1
            alive.append(weakref.ref(step_ids))
        # The rows as the output processor receives them (materialize's views), built outside the timing.
        rows = [SamplingMaskLists(step_ids[bounds[i]:bounds[i + 1]], None) for i in range(num_reqs)]
        del step_ids
        t0, f0 = time.process_time(), _minor_faults()
        for i, acc in enumerate(accs):
            acc.append(rows[i], None, 1, 1, num_done[i])
        cpu["append"] += time.process_time() - t0
        faults["append"] += _minor_faults() - f0
        del rows
        if lengths is not None:
            t0, f0 = time.process_time(), _minor_faults()
            for i in range(num_reqs):
                num_done[i] += 1
                remaining[i] -= 1
                if remaining[i] == 0:  # handed over, its ids read, dropped; a new request in its place
                    assert len(accs[i].take(keep=False).ids) == sizes[i] * num_done[i]
                    accs[i] = MaskAccumulator(f"{i}.{num_done[i]}")
                    num_done[i], remaining[i] = 0, new_length()
                    num_finished += 1
            cpu["finish"] += time.process_time() - t0
            faults["finish"] += _minor_faults() - f0
    gc.collect()
    # The step arrays still alive: the copied-out ones and the slots (each one step's array) still in use.
    retained = sum(ref() is not None for ref in alive) + sum(s.in_use() for s in slots)
    masks = []
    if lengths is None:
        t0, f0 = time.process_time(), _minor_faults()
        # NOTE: kept, as LLM.generate returns them all: their ids cannot reuse each other's memory.
        masks = [acc.take(keep=False) for acc in accs]
        assert sum(len(mask.ids) for mask in masks) == int(offsets[-1]) * steps
        cpu["finish"] += time.process_time() - t0
        faults["finish"] += _minor_faults() - f0
    return {"ms_per_step": 1e3 * sum(cpu.values()) / steps,
            **{f"{k}_ms_per_step": 1e3 * v / steps for k, v in cpu.items()},
            **{f"{k}_faults": v for k, v in faults.items()},
            "step_arrays_alive": retained, "steps_copied_out": num_copied_out, "requests_finished": num_finished,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _minor_faults() -> int:
    """Minor page faults of this process so far: each a 4 KB page of fresh memory touched for the first time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--mask-size", type=int, default=500, help="mean ids per mask (uniform, half to 1.5x)")
    parser.add_argument("--lengths", type=int, nargs=2, default=None, metavar=("LO", "HI"))
    parser.add_argument("--trees", nargs="+", default=["."], help="source trees whose vllm to run (PYTHONPATH)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    lengths = tuple(args.lengths) if args.lengths else None
    if args.child:
        print(json.dumps(run(args.num_reqs, args.steps, args.mask_size, lengths)))  # type: ignore[arg-type]
        return
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    child = [sys.executable, os.path.abspath(__file__), "--child", "--num-reqs", str(args.num_reqs), "--steps",
             str(args.steps), "--mask-size", str(args.mask_size)] + (
        ["--lengths", *map(str, lengths)] if lengths else [])
    for r in range(args.rounds):
        for tree in args.trees if r % 2 == 0 else args.trees[::-1]:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
            out = subprocess.run(child, env=env, check=True, capture_output=True, text=True).stdout
            results[tree].append(json.loads(out.strip().splitlines()[-1]))
    shape = "batch" if lengths is None else f"lengths {lengths[0]}..{lengths[1]}"
    print(f"{args.num_reqs} requests, {args.steps} steps, ~{args.mask_size} ids per mask, {shape}; median of "
          f"{args.rounds} (ms of CPU per step):")
    for tree, runs in results.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        each = ", ".join(f"{r['ms_per_step']:.2f}" for r in runs)
        print(f"  {tree}: {med['ms_per_step']:.2f} (runs {each}) = "
              f"copy-out {med['copy_ms_per_step']:.2f} + appends {med['append_ms_per_step']:.2f} + hand-overs "
              f"{med['finish_ms_per_step']:.2f}; page faults {med['copy_faults']:.0f} / {med['append_faults']:.0f}"
              f" / {med['finish_faults']:.0f}; step arrays alive at the end {med['step_arrays_alive']:.0f}, "
              f"copied out {med['steps_copied_out']:.0f} of {args.steps}; peak RSS {med['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
