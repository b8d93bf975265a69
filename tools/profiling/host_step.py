"""The engine core's host work per decode step, without a device: schedule(), update_from_output() and the
output messages (split per API server, packed, encoded), for N running requests, mask off and on.

What it isolates: the part of a serving step that the engine-core process spends in Python/numpy whatever the
GPU does. The model runner output is synthetic and built once (one sampled token, logprobs=1, a mask of
`--mask-size` ids per row with its JSON text), so the numbers are the scheduler and transport cost alone.

    python tools/profiling/host_step.py --num-reqs 1024 --clients 1 4 [--async-scheduling] [--cprofile]

`--async-scheduling` runs AsyncScheduler the way the engine's two-deep batch queue does: each step schedules
step N+1 while step N is in flight, then processes step N's output. Every request then has one output
placeholder when it is scheduled (two after) and two when its output is processed (one after), so the timed
steps take the placeholder paths of schedule() and update_from_output() that serving takes.

Prints the median ms per step for each (arm, clients) and the mask arm's extra cost; `--json-out` writes them.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from typing import Any

import numpy as np

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core_proc import EngineCoreProc
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, SamplingMaskText, StepRowSettings
from vllm.v1.request import Request
from vllm.v1.sample.sampling_mask import group_order
from vllm.v1.serial_utils import MsgpackEncoder

VOCAB_SIZE = 151_936


class _SinkProc(EngineCoreProc):
    """EngineCoreProc's output path with the sockets replaced by a byte counter."""

    def __init__(self, num_clients: int) -> None:  # noqa: super().__init__ would open sockets
        self.output_sockets = [None] * num_clients
        self.client_of = {}
        self.encoder = MsgpackEncoder()
        self.bytes_sent = 0

    def send(self, kind: bytes, payload: Any, client: int = 0) -> None:
        self.bytes_sent += sum(len(f) for f in self.encoder.encode_frames(payload))


def _vllm_config(num_reqs: int) -> VllmConfig:
    """The engine config of a one-layer model with room for `num_reqs` running requests; the model's config is
    read from a folder removed once it is read (nothing here loads weights)."""
    with tempfile.TemporaryDirectory(prefix="host-step-model-") as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["Qwen2ForCausalLM"], "vocab_size": VOCAB_SIZE, "hidden_size": 16,
                       "num_attention_heads": 2, "num_hidden_layers": 1, "max_position_embeddings": 1 << 20}, f)
        model_config = ModelConfig(model=path, max_model_len=100_000)
    return VllmConfig(model_config=model_config, cache_config=CacheConfig(block_size=16),
                      scheduler_config=SchedulerConfig(max_num_seqs=num_reqs,
                                                       max_num_batched_tokens=max(8192, num_reqs * 8)))


def _runner_output(req_ids: list[str], mask: bool, mask_size: int, rng: np.random.Generator,
                   client_of: dict[str, int] | None = None, row_settings: bool = True) -> ModelRunnerOutput:
    """One decode step's output for `req_ids`, as the model runner gives it to an API server's engine: with
    `client_of`, the mask texts packed by client as the device packs them (json_rows_packed with the rows'
    client_index) and the lists holding the sizes only (the ids stay on the device); with `row_settings`, the
    runner's per-row settings (StepRowSettings), without them the scheduler reads each request's."""
    n = len(req_ids)
    sampled = rng.integers(3, VOCAB_SIZE, n)
    lp_ids = np.stack([sampled, rng.integers(3, VOCAB_SIZE, n)], axis=1).astype(np.int32)
    logprobs = LogprobsLists(lp_ids, -rng.random((n, 2), dtype=np.float32), np.ones(n, np.int32), None)
    masks = texts = None
    if mask:
        ids = np.sort(rng.choice(VOCAB_SIZE, (n, mask_size)), axis=1).astype(np.int32)
        masks = SamplingMaskLists(ids.reshape(-1), np.arange(n + 1, dtype=np.int64) * mask_size, None)
        rows = [("[" + ",".join(map(str, row)) + "]").encode() for row in ids.tolist()]
        order = np.arange(n)
        rank = None
        if client_of is not None:
            order, rank = group_order(np.array([client_of[r] for r in req_ids]))
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum([len(rows[r]) for r in order], out=offsets[1:])
        texts = SamplingMaskText(np.frombuffer(b"".join(rows[r] for r in order), dtype=np.uint8), offsets, None, rank)
        if client_of is not None:
            masks = masks._replace(token_ids=None)
    settings = StepRowSettings(np.ones(n, dtype=bool), np.full(n, mask), np.full(n, 512, dtype=np.int32))
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[int(t)] for t in sampled], logprobs=logprobs,
                             sampling_masks=masks, sampling_mask_text=texts,
                             row_settings=settings if row_settings else None)


def run(num_reqs: int, num_clients: int, mask: bool, steps: int, mask_size: int, profile: str | None,
        async_scheduling: bool = False, row_settings: bool = True) -> dict:
    config = _vllm_config(num_reqs)
    sched = (AsyncScheduler if async_scheduling else Scheduler)(config, max(num_reqs * 64, 100_000 // 16 + 1))
    proc = _SinkProc(num_clients)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, max_tokens=100_000,
                            ignore_eos=True, return_sampling_mask=mask or None)
    for i in range(num_reqs):
        req_id = f"cmpl-{i:08x}-0"
        sched.add_request(Request(req_id, list(range(3, 3 + 8)), params, None))
        proc.client_of[req_id] = i % num_clients
    rng = np.random.default_rng(0)
    out = sched.schedule()  # the prefill step
    in_flight = None
    if async_scheduling:
        # NOTE: the prefill step stays in flight, so each timed step schedules the next one before processing it.
        in_flight = out
    else:
        sched.update_from_output(out, _runner_output(list(out.num_scheduled_tokens), mask, mask_size, rng,
                                                     proc.client_of, row_settings))
    runner_output = None
    times: dict[str, list[float]] = {"schedule": [], "update": [], "send": [], "total": []}
    profiler = cProfile.Profile() if profile else None
    for step in range(steps + 2):
        t0 = time.perf_counter()
        if profiler and step == 2:
            profiler.enable()
        out = sched.schedule()
        t1 = time.perf_counter()
        if in_flight is not None:
            out, in_flight = in_flight, out
        if runner_output is None:
            # NOTE: one output for every step: each schedules all requests, so the rows are the same.
            runner_output = _runner_output(list(out.num_scheduled_tokens), mask, mask_size, rng, proc.client_of,
                                           row_settings)
        outputs = sched.update_from_output(out, runner_output)
        t2 = time.perf_counter()
        proc.send_outputs(outputs)
        t3 = time.perf_counter()
        if step >= 2:  # two warm-up steps
            for key, dt in (("schedule", t1 - t0), ("update", t2 - t1), ("send", t3 - t2), ("total", t3 - t0)):
                times[key].append(dt)
    if async_scheduling:
        # The timed steps took the placeholder paths: the last scheduled step is still in flight for every request.
        assert len(sched.running) == num_reqs and all(r.num_output_placeholders == 1 for r in sched.running)
    if profiler:
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(25)
    # Medians: a step now and then also pays for a garbage collection or a page fault.
    result = {k: 1e3 * float(np.median(v)) for k, v in times.items()}
    result["mb_per_step"] = proc.bytes_sent / (steps + 2) / 1e6  # the prefill step is not sent
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-reqs", type=int, nargs="+", default=[1024])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--mask-size", type=int, default=512)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="AsyncScheduler, one step in flight while the next is scheduled (the engine's order).")
    parser.add_argument("--cprofile", action="store_true", help="Print a cProfile of the mask arm's steps.")
    parser.add_argument("--request-settings", action="store_true",
                        help="Runner outputs without their per-row settings: the scheduler reads the requests'.")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    rows = []
    print(f"{'reqs':>5} {'clients':>7} {'arm':>7} {'schedule':>9} {'update':>8} {'send':>8} {'total ms':>9} "
          f"{'MB/step':>8}")
    for n in args.num_reqs:
        for clients in args.clients:
            by_arm = {}
            for mask in (False, True):
                r = run(n, clients, mask, args.steps, args.mask_size, "mask" if args.cprofile and mask else None,
                        args.async_scheduling, not args.request_settings)
                arm = "mask" if mask else "no-mask"
                by_arm[arm] = r
                rows.append({"num_reqs": n, "clients": clients, "arm": arm, **r})
                print(f"{n:>5} {clients:>7} {arm:>7} {r['schedule']:>9.2f} {r['update']:>8.2f} {r['send']:>8.2f} "
                      f"{r['total']:>9.2f} {r['mb_per_step']:>8.2f}")
            print(f"{'':>5} {'':>7} {'extra':>7} {by_arm['mask']['total'] - by_arm['no-mask']['total']:>47.2f}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
