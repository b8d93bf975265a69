"""The tensor-parallel step broadcast's cost (vllm/v1/executor/distributed.py): a decode step's SchedulerOutput of
N running requests sent from rank 0 to the other ranks with the step group's `broadcast_object` (gloo), as the
driver does before every step. Prints the microseconds per broadcast and the pickled size, per N.

    python tools/profiling/step_broadcast.py --ranks 2 --num-reqs 8 256 1024

Run it on an idle host: on a loaded one the gloo threads' wake-ups dominate (a shared 2-core machine measured
0.5-2 ms per broadcast, without order in N).
"""

from __future__ import annotations

import argparse
import pickle
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from vllm.distributed.parallel_state import GroupCoordinator
from vllm.utils import get_open_port
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput


def decode_step(num_reqs: int) -> SchedulerOutput:
    """A decode step of num_reqs running requests, one in 16 getting a new KV block."""
    ids = [f"cmpl-{i:032x}-0" for i in range(num_reqs)]
    cached = CachedRequestData(ids, [[1000 + i] if i % 16 == 0 else [] for i in range(num_reqs)],
                               [300 + i for i in range(num_reqs)])
    return SchedulerOutput([], cached, {r: 1 for r in ids}, num_reqs, set())


def member(rank: int, world_size: int, port: int, num_reqs: int, iters: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world_size, rank=rank)
    ranks = list(range(world_size))
    group = GroupCoordinator(ranks=ranks, rank=rank, local_rank=rank,
                             cpu_group=dist.new_group(ranks, backend="gloo", timeout=timedelta(hours=1)))
    step = decode_step(num_reqs) if rank == 0 else None
    for _ in range(20):
        group.broadcast_object(step)
    start = time.perf_counter()
    for _ in range(iters):
        group.broadcast_object(step)
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"ranks={world_size} num_reqs={num_reqs}: {1e6 * elapsed / iters:.0f} us per broadcast, "
              f"{len(pickle.dumps(step))} bytes pickled", flush=True)
    group.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-reqs", type=int, nargs="+", default=[8, 256, 1024])
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args()
    for num_reqs in args.num_reqs:
        mp.spawn(member, args=(args.ranks, get_open_port(), num_reqs, args.iters), nprocs=args.ranks)


if __name__ == "__main__":
    main()
