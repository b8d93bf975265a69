"""The in-process frontend's mask work per step, and what it keeps alive: N requests' MaskAccumulators fed one id
row per request per step, as the output processor feeds them (each row a view of its step's int32 array, as a
lent staging slot's), then each request's hand-over and `SamplingMask.ids` when it finishes.

    python tools/profiling/mask_retention.py [--num-reqs 1024] [--steps 256] [--mask-size 500] [--repeats 3]
    PYTHONPATH=/other/tree python tools/profiling/mask_retention.py ...   # the same on another tree's vllm

Prints ms per step of the appends (best of `--repeats` runs, CPU time of this process), ms per request of the
finish (take + ids), and the most step arrays one request's accumulator kept alive (weak references to every
step's array, counted at the last step: before compaction every step's array is alive, after it at most K).
"""

from __future__ import annotations

import argparse
import gc
import time
import weakref

import numpy as np
import torch

from vllm.v1.engine.mask_accumulator import MaskAccumulator
from vllm.v1.host_staging import HostStagingSlot
from vllm.v1.outputs import SamplingMaskLists
from vllm.v1.worker.async_output import _MAX_LENDING_SLOTS


def run(num_reqs: int, steps: int, mask_size: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    sizes = rng.integers(mask_size // 2, mask_size * 3 // 2 + 1, num_reqs)
    offsets = np.zeros(num_reqs + 1, np.int64)
    offsets[1:] = np.cumsum(sizes)
    bounds = offsets.tolist()
    # One step's ids (the same every step: what they are does not change the cost).
    template = rng.integers(0, 151_936, int(offsets[-1]), dtype=np.int32)
    accs = [MaskAccumulator(str(i)) for i in range(num_reqs)]
    alive: list[weakref.ref] = []
    append_s = 0.0
    copy_s = 0.0
    num_copied_out = 0
    source = torch.from_numpy(template)
    slots: list[HostStagingSlot] = []
    for step in range(steps):
        # The step's ids as the in-process engine on CUDA hands them over (vllm/v1/worker/async_output.py): in a
        # lending staging slot that no view keeps in use (up to _MAX_LENDING_SLOTS of them), else copied out into
        # fresh memory (the step's alternating slot, then tolists' copy). Timed: the copy out, host work per step.
        t0 = time.process_time()
        slot = next((s for s in slots if not s.in_use()), None)
        if slot is None and len(slots) < _MAX_LENDING_SLOTS:
            slots.append(HostStagingSlot(pin=False, lends=True))
            slot = slots[-1]
        if slot is not None:
            copy_s += time.process_time() - t0
            step_ids = slot.array("ids", slot.copy(source, "ids"))  # NOTE: untimed, the device's DMA on CUDA
        else:
            step_ids = template.copy()
            copy_s += time.process_time() - t0
            num_copied_out += 1
            alive.append(weakref.ref(step_ids))
        # The rows as the output processor receives them (materialize's views), built outside the timing.
        rows = [SamplingMaskLists(step_ids[bounds[i]:bounds[i + 1]], None) for i in range(num_reqs)]
        del step_ids
        t0 = time.process_time()
        for i, acc in enumerate(accs):
            acc.append(rows[i], None, 1, 1, step)
        append_s += time.process_time() - t0
        del rows
    gc.collect()
    # The step arrays still alive: the copied-out ones and the slots (each one step's array) still in use.
    retained = sum(ref() is not None for ref in alive) + sum(s.in_use() for s in slots)
    del slots
    t0 = time.process_time()
    total = 0
    for acc in accs:
        total += len(acc.take(keep=False).ids)
    finish_s = time.process_time() - t0
    assert total == int(offsets[-1]) * steps
    return {"append_ms_per_step": 1e3 * append_s / steps, "copy_ms_per_step": 1e3 * copy_s / steps,
            "finish_ms_per_req": 1e3 * finish_s / num_reqs,
            "total_ms_per_step": 1e3 * (append_s + copy_s + finish_s) / steps, "step_arrays_retained": retained,
            "steps_copied_out": num_copied_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--mask-size", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compact-pieces", type=int, default=None, help="MaskAccumulator.COMPACT_PIECES (K)")
    args = parser.parse_args()
    if args.compact_pieces is not None:
        MaskAccumulator.COMPACT_PIECES = args.compact_pieces
    results = []
    for _ in range(args.repeats):
        results.append(run(args.num_reqs, args.steps, args.mask_size))
        gc.collect()
    best = {k: min(r[k] for r in results) for k in results[0]}
    runs = ", ".join(f"{r['total_ms_per_step']:.2f}" for r in results)
    print(f"{args.num_reqs} requests x {args.steps} steps x ~{args.mask_size} ids, ms per step (best of "
          f"{args.repeats}): all {best['total_ms_per_step']:.2f} (runs: {runs}) = appends "
          f"{best['append_ms_per_step']:.2f} + copy-out {best['copy_ms_per_step']:.2f} + finish "
          f"{best['finish_ms_per_req'] * args.num_reqs / args.steps:.2f} (take + ids, "
          f"{best['finish_ms_per_req']:.3f} ms per request); step arrays alive at the end: "
          f"{int(best['step_arrays_retained'])} of {args.steps}, steps copied out of a slot: "
          f"{int(best['steps_copied_out'])}")

if __name__ == "__main__":
    main()
