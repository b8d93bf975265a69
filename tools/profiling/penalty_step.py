"""What penalties add to a decode step: host ms per phase, and on CUDA device ms per phase and the extra kernels.

The real engine core in process (scheduler, model runner, sampler, output copies) on the serving A/B's sampling
settings (temperature 1, top_p 0.95, top_k 512, logprobs 1, processed logprobs, sampling mask), two arms on one
engine: `plain`, and `penalties` (the same plus presence_penalty and repetition_penalty, default 0.5 and 1.1 as
the A/B's penalty arm). Per arm and round, `--rows` requests with `--input-len`-token prompts are prefilled, a
few decode steps settle, then `--steps` decode steps are timed. Arms alternate (A B, B A, ...) over `--rounds`.

Phases (the engine's own methods, wrapped here; nothing in `vllm/` reads a switch for this):
- schedule: Scheduler.schedule; update: Scheduler.update_from_output; wait: AsyncModelRunnerOutput.get_output
  (on CUDA, the host waiting for the step's outputs);
- prepare: InputBuffers.prepare (the flat inputs and their H2D copies); metadata: ModelRunner._sampling_metadata,
  of which penalty fields: step_penalty_fields (the per-row penalty buffers and their H2D copies);
- forward: ModelRunner._forward_rows (a graph replay on CUDA); logits: the eager LM head;
- sampler: the sampler graph's replay (ModelRunner._sample_graphed) or the eager sampler;
- count: count_sampled (the penalty state update after the sampler, eager); finish: ModelRunner._finish_step
  (the output copies' submission);
- step: EngineCore.step, whole; other: step minus the phases above.
Host ms is the median over the timed steps of each phase's time summed within the step. On CUDA each wrapped call
also records two CUDA events on the current stream: device ms is the span between them (the work the call
enqueued, plus any gap the device waited for the host inside the call), summed per step, median over steps.
Admission: PenaltyState.alloc per request (the prompt's presence bits), timed while the arm's requests are added.
Also per arm: the one-time events (the penalty pool's growth, each sampler-graph capture, with seconds) and the
dtype of the logits the top-k select reads (the model's bf16 without penalties; the penalty kernel's float32
copy with them).

On CUDA also: `--sync-debug` counts synchronizing CUDA calls per step (torch.cuda.set_sync_debug_mode) with the
Python line of each; `--kernels` traces `--steps` more steps per arm with torch.profiler (CUDA activity only)
and lists the kernels only the penalties arm runs and the stages' ms (gpu_kernel_profile.summarize).

    python tools/profiling/penalty_step.py --device cpu --rows 32 --steps 10            # CPU, small model
    python3 tools/profiling/penalty_step.py --device cuda --rows 256 1024 --steps 30 --rounds 2 --mask-text \\
        --sync-debug --kernels --json-out out/penalty_step.json                         # GPU, the A/B's model

`--host-ops 256 1024` (no model, any device): the penalty-only host operations of a decode step at serving batch
sizes, on the runner's own InputBatch / InputBuffers: step_penalty_fields (both arms: without penalties it is the
early return), the sampler graph key's part (LogitsProcessorTensors.graph_key), update_state's op count and time,
and PenaltyState.alloc per admitted request; medians of `--steps` calls.

On CPU the model is the Qwen2.5-1.5B config in bfloat16 (`--dtype`) cut to `--cpu-layers` layers of
`--cpu-hidden` (the vocabulary, which the penalties' cost scales with, stays 151,936); the sampler then runs eagerly
in torch (no graphs; the penalty op is the Triton kernel's torch reference, ~10x its bytes), so its phase is
compute, not launch cost. `--full-model` keeps the whole config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_kernel_profile  # noqa: E402

CONFIG = gpu_kernel_profile.CONFIG
# Top-level phases, in step order (their host times add up to about the step's); SUB phases lie inside one of them.
PHASES = ("schedule", "prepare", "metadata", "forward", "logits", "sampler", "count", "finish", "wait", "update")
SUB = ("penalty fields",)


class PhaseTimer:
    """Host (and on CUDA, device) time of wrapped calls, grouped by phase and by step."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.active = False
        self.host: dict[str, float] = defaultdict(float)
        self.events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = defaultdict(list)
        self.steps: list[tuple[dict[str, float], dict[str, list]]] = []
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            # NOTE: never inside a CUDA-graph capture (an event record would be captured) or outside timed steps.
            if not self.active or (self.cuda and torch.cuda.is_current_stream_capturing()):
                return fn(*args, **kwargs)
            start = end = None
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.host[phase] += time.perf_counter() - t0
                self.calls[phase] += 1
                if end is not None:
                    end.record()
                    self.events[phase].append((start, end))
        return timed

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        self.host, self.events = defaultdict(float), defaultdict(list)
        self.active = True
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.host["step"] = time.perf_counter() - t0
            self.active = False
            self.steps.append((self.host, self.events))

    def summary(self) -> dict[str, dict[str, float]]:
        """Median ms per step of each phase: {"host": ..., "device": ...} (device only on CUDA)."""
        if self.cuda:
            torch.cuda.synchronize()
        for h, _ in self.steps:
            h["other"] = h["step"] - sum(h.get(p, 0.0) for p in PHASES)
        host = {p: 1e3 * float(np.median([h.get(p, 0.0) for h, _ in self.steps])) for p in (*PHASES, *SUB, "other",
                                                                                             "step")}
        out = {"host": host}
        if self.cuda:
            out["device"] = {p: float(np.median([sum(s.elapsed_time(e) for s, e in ev.get(p, []))
                                                 for _, ev in self.steps])) for p in (*PHASES, *SUB)}
        self.steps = []
        return out


def _model_dir(args: argparse.Namespace, tmp: str) -> str:
    """The A/B's model config, or on CPU a cut of it (module docstring)."""
    if args.full_model or args.device == "cuda":
        return args.model
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    config.update(num_hidden_layers=args.cpu_layers, hidden_size=args.cpu_hidden, intermediate_size=2 * args.cpu_hidden,
                  num_attention_heads=2, num_key_value_heads=1)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(config, f)
    return tmp


def _instrument(core: Any, timer: PhaseTimer) -> dict[str, Any]:
    """Wrap the engine's phase methods (instance attributes, or module globals the runner calls); returns the
    objects the report reads (runner, penalty pool, admission times)."""
    from vllm.v1.sample import fast_path
    from vllm.v1.worker import async_output, model_runner as mr

    runner = core.worker.model_runner
    module_level = [(mr, "step_penalty_fields", mr.step_penalty_fields), (mr, "count_sampled", mr.count_sampled),
                    (fast_path, "select_top_k_candidates", fast_path.select_top_k_candidates),
                    (async_output.AsyncModelRunnerOutput, "get_output", async_output.AsyncModelRunnerOutput.get_output)]
    sched = core.scheduler
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("update", sched.update_from_output)
    buffers = runner.input_buffers
    buffers.prepare = timer.wrap("prepare", buffers.prepare)
    runner._sampling_metadata = timer.wrap("metadata", runner._sampling_metadata)
    mr.step_penalty_fields = timer.wrap("penalty fields", mr.step_penalty_fields)
    runner._forward_rows = timer.wrap("forward", runner._forward_rows)
    runner.model.compute_logits = timer.wrap("logits", runner.model.compute_logits)
    runner._sample_graphed = timer.wrap("sampler", runner._sample_graphed)
    runner.sampler = timer.wrap("sampler", runner.sampler)
    mr.count_sampled = timer.wrap("count", mr.count_sampled)
    runner._finish_step = timer.wrap("finish", runner._finish_step)
    async_output.AsyncModelRunnerOutput.get_output = timer.wrap("wait", async_output.AsyncModelRunnerOutput.get_output)
    # The dtype of the logits the top-k select reads (the fast path's one full-vocabulary read) in an arm's steps;
    # on CUDA seen only where the arm captures its sampler graphs (a replay calls no Python).
    select_dtypes: set[str] = set()
    select = fast_path.select_top_k_candidates

    def recorded_select(logits: torch.Tensor, *a: Any, **kw: Any) -> Any:
        select_dtypes.add(str(logits.dtype).replace("torch.", ""))
        return select(logits, *a, **kw)

    fast_path.select_top_k_candidates = recorded_select
    pool = runner.input_batch.penalty_state
    admission: list[float] = []
    alloc = pool.alloc

    def timed_alloc(*a: Any, **kw: Any) -> int:
        t0 = time.perf_counter()
        try:
            return alloc(*a, **kw)
        finally:
            admission.append(time.perf_counter() - t0)

    pool.alloc = timed_alloc
    # One-time events of an arm: the pool's growth (a new [slots + 1, V] table: new addresses, so new sampler graph
    # keys) and the sampler graphs' captures (every size, both sets), with their seconds.
    events: list[str] = []
    grow = pool._grow

    def logged_grow(capacity: int, width: int) -> None:
        t0 = time.perf_counter()
        grow(capacity, width)
        events.append(f"pool -> {capacity} slots x {width} ({time.perf_counter() - t0:.3f} s)")

    pool._grow = logged_grow
    graphs = runner.sampler_graphs
    if graphs is not None:
        capture_all = graphs._capture_all

        def logged_capture(key: Any, make_fn: Any) -> None:
            t0 = time.perf_counter()
            capture_all(key, make_fn)
            events.append(f"sampler graphs captured ({time.perf_counter() - t0:.1f} s, penalties: "
                          f"{key[-1] is not None})")

        graphs._capture_all = logged_capture

    def undo() -> None:
        """Put back the module and class attributes (the engine's own attributes go with it)."""
        for owner, name, original in module_level:
            setattr(owner, name, original)

    return {"runner": runner, "pool": pool, "admission": admission, "events": events, "undo": undo,
            "select_dtypes": select_dtypes}


@contextlib.contextmanager
def _sync_warnings(enabled: bool) -> Iterator[list[warnings.WarningMessage]]:
    """Record the synchronizing CUDA calls made inside (torch's sync debug mode, as warnings)."""
    if not enabled:
        yield []
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode("default")


def run_arm(llm: Any, handles: dict[str, Any], timer: PhaseTimer, arm: str, tag: str,
            args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    core = engine.engine_core.engine_core
    penalties = {"presence_penalty": args.presence, "repetition_penalty": args.repetition} if arm == "penalties" else {}
    extra = args.steps if args.kernels else 0
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, ignore_eos=True,
                            max_tokens=args.settle + args.steps + extra + 16, **penalties)
    vocab = engine.vllm_config.model_config.vocab_size
    rng = np.random.default_rng(0)
    rows = args.rows_now
    req_ids = [f"{tag}-{i}" for i in range(rows)]
    handles["admission"].clear()
    handles["events"].clear()
    handles["select_dtypes"].clear()
    for req_id in req_ids:
        engine.add_request(req_id, {"prompt_token_ids": rng.integers(0, vocab, args.input_len).tolist()}, params)
    sched = core.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        core.step()
    admission = list(handles["admission"])
    for _ in range(args.settle):
        core.step()
    if timer.cuda:
        torch.cuda.synchronize()
    graphs = handles["runner"].sampler_graphs
    with _sync_warnings(args.sync_debug and timer.cuda) as caught:
        for _ in range(args.steps):
            with timer.step():
                core.step()
    calls = dict(timer.calls)
    timer.calls.clear()
    result: dict[str, Any] = {"arm": arm, "rows": rows, **timer.summary(), "calls_per_step":
                              {k: v / args.steps for k, v in calls.items()}}
    result["admission_us_per_request"] = 1e6 * float(np.mean(admission)) if admission else 0.0
    result["admission_requests"] = len(admission)
    pool = handles["pool"]
    result["penalty_pool"] = {"slots": pool.capacity, "width": pool.width,
                              "state_mb": pool.state.numel() * pool.state.element_size() / 1e6}
    result["sampler_graph_keys"] = None if graphs is None else len(graphs.keys)
    result["one_time"] = list(handles["events"])
    result["select_reads"] = sorted(handles["select_dtypes"])
    if caught:
        where: dict[str, int] = defaultdict(int)
        for w in caught:
            if "synchroniz" in str(w.message):
                where[f"{os.path.relpath(w.filename)}:{w.lineno}"] += 1
        result["syncs_per_step"] = {k: v / args.steps for k, v in sorted(where.items(), key=lambda kv: -kv[1])}
    if args.kernels and timer.cuda:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(args.steps):
                core.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        path = os.path.join(tempfile.gettempdir(), f"penalty_step_{tag}.json")
        prof.export_chrome_trace(path)
        result["kernels"] = gpu_kernel_profile.summarize(path, args.steps, wall)
        os.remove(path)
    core.abort_requests(req_ids)
    engine.output_processor.abort_requests(req_ids)
    while core.has_unfinished_requests():
        core.step()
    return result


def host_ops(rows: int, args: argparse.Namespace) -> dict[str, Any]:
    """The penalty-only host operations of one decode step of `rows` rows, without a model (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    from vllm import SamplingParams
    from vllm.v1.core.sched.output import NewRequestData
    from vllm.v1.sample.ops.penalties import _COUNT_MASK, update_state
    from vllm.v1.worker.input_batch import InputBatch
    from vllm.v1.worker.input_prep import InputBuffers
    from vllm.v1.worker.penalty_state import step_penalty_fields

    device = torch.device(args.device)
    vocab = 151_936
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"rows": rows}

    def median_us(fn: Callable[[], Any]) -> float:
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return 1e6 * float(np.median(times))

    for arm in ("plain", "penalties"):
        batch = InputBatch(rows, args.input_len + 64, 16, vocab, device, True)
        buffers = InputBuffers(rows, rows, args.input_len + 64, 16, 16, 0, device)
        extra = {"presence_penalty": args.presence, "repetition_penalty": args.repetition} if arm == "penalties" else {}
        params = SamplingParams(temperature=1.0, top_p=0.95, top_k=512, logprobs=1, **extra)
        alloc: list[float] = []
        for i in range(rows):
            t0 = time.perf_counter()
            batch.add_request(NewRequestData(f"r{i}", rng.integers(0, vocab, args.input_len).tolist(), [], params,
                                             [i], args.input_len, eos_token_id=151645))
            alloc.append(time.perf_counter() - t0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        row_ids = np.arange(rows, dtype=np.int64)
        samples = np.ones(rows, dtype=bool)
        req_ids = list(batch.req_ids)
        # NOTE: the runner's tensor(): padded to the step's rows (none here), into the persistent buffer, H2D copy.
        fields = lambda: step_penalty_fields(batch, req_ids, row_ids, samples, buffers,  # noqa: E731
                                             lambda buf, v, neutral: buffers.sampling_tensor(buf, v), vocab)
        out[f"{arm} add_request us"] = 1e6 * float(np.median(alloc))
        out[f"{arm} penalty fields us"] = median_us(fields)
        f = fields()
        if arm == "plain":
            continue
        out["graph key us"] = median_us(f["processors"].graph_key)
        sampled = torch.from_numpy(rng.integers(0, vocab, rows)).to(device)
        proc = f["processors"]

        def count() -> None:
            update_state(proc.state, proc.recent, f["penalty_slot"], f["penalty_weight"], sampled)

        out["update_state us"] = median_us(count)
        # The timed calls counted the same token of each row `steps` times (its prompt bit aside).
        counts = (proc.state[f["penalty_slot"], sampled] & _COUNT_MASK).cpu().numpy()
        if not (counts == args.steps).all():
            raise RuntimeError(f"update_state counted {counts.tolist()}, not {args.steps} each")
        if device.type == "cuda":
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(10):
                    count()
                torch.cuda.synchronize()
                wall = time.perf_counter() - t0
            path = os.path.join(tempfile.gettempdir(), f"penalty_host_ops_{rows}.json")
            prof.export_chrome_trace(path)
            kernels = gpu_kernel_profile.summarize(path, 10, wall)["kernels_us"]
            os.remove(path)
            out["update_state kernels"] = sum(calls for _, calls in kernels.values())
            out["update_state device us"] = sum(us for us, _ in kernels.values())
            out["update_state kernel names"] = ", ".join(kernels)
        else:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                count()
            # The top-level ops: on CUDA each launches one kernel or more (views none).
            out["update_state ops"] = ", ".join(e.name for e in prof.events() if e.cpu_parent is None)
    return out


def report(rows: int, results: list[dict[str, Any]]) -> None:
    by_arm: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_arm[r["arm"]].append(r)
    arms = [a for a in ("plain", "penalties") if a in by_arm]
    cuda = "device" in results[0]
    kinds = "host / device" if cuda else "host"
    print(f"\n### {rows} rows: ms per decode step, median over steps, mean over rounds ({kinds})\n")
    print("| phase | " + " | ".join(arms) + " | penalties - plain |\n|---|" + "---:|" * (len(arms) + 1))

    def mean(arm: str, kind: str, phase: str) -> float:
        return float(np.mean([r[kind].get(phase, 0.0) for r in by_arm[arm]]))

    for phase in (*PHASES, *SUB, "other", "step"):
        cells, diffs = [], []
        for kind in ("host", "device") if cuda else ("host",):
            if kind == "device" and phase in ("other", "step"):
                continue
            vals = [mean(a, kind, phase) for a in arms]
            cells.append(vals)
            diffs.append(vals[-1] - vals[0] if len(vals) == 2 else 0.0)
        text = [" / ".join(f"{c[i]:.3f}" for c in cells) for i in range(len(arms))]
        print(f"| {phase} | " + " | ".join(text) + " | " + " / ".join(f"{d:+.3f}" for d in diffs) + " |")
    for arm in arms:
        r = by_arm[arm][-1]
        print(f"\n{arm}: rounds (step host ms) {[round(x['host']['step'], 3) for x in by_arm[arm]]}; admission "
              f"{r['admission_us_per_request']:.0f} us per request ({r['admission_requests']} requests); pool "
              f"{r['penalty_pool']}; sampler graph keys {r['sampler_graph_keys']}; the top-k select reads "
              f"{r['select_reads']} logits; calls per step "
              f"{ {k: round(v, 2) for k, v in r['calls_per_step'].items()} }")
        for x in by_arm[arm]:
            print(f"{arm} round {x['round']}: one-time events {x['one_time'] or 'none'}")
        if "syncs_per_step" in r:
            print(f"{arm}: synchronizing calls per step: {r['syncs_per_step'] or 'none'}")
    if all("kernels" in by_arm[a][-1] for a in arms) and len(arms) == 2:
        off, on = by_arm["plain"][-1]["kernels"], by_arm["penalties"][-1]["kernels"]
        gpu_kernel_profile.report(off, on, rows, 25)
        print("\n(in that table 'mask off' is the plain arm and 'mask on' the penalties arm)")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=CONFIG)
    parser.add_argument("--full-model", action="store_true", help="on CPU, the whole config (slow)")
    parser.add_argument("--dtype", default="bfloat16", help="the A/B's bfloat16 on any device (CPU's auto: float32)")
    parser.add_argument("--cpu-layers", type=int, default=2)
    parser.add_argument("--cpu-hidden", type=int, default=128)
    parser.add_argument("--rows", type=int, nargs="+", default=[32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--settle", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1, help="arms A B, then B A, ...")
    parser.add_argument("--arms", nargs="+", choices=["plain", "penalties"], default=["plain", "penalties"])
    parser.add_argument("--presence", type=float, default=0.5)
    parser.add_argument("--repetition", type=float, default=1.1)
    parser.add_argument("--mask-text", action="store_true", help="masks as JSON text on the device, as when serving")
    parser.add_argument("--no-mask", action="store_true", help="without --return-sampling-mask")
    parser.add_argument("--sync-debug", action="store_true", help="CUDA: count synchronizing calls per step")
    parser.add_argument("--kernels", action="store_true", help="CUDA: kernel profile of both arms")
    parser.add_argument("--host-ops", type=int, nargs="+", default=None, metavar="ROWS",
                        help="only the penalty-only host operations at these row counts, without a model")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.host_ops:
        if args.steps < 20:
            args.steps = 50
        rows_out = [host_ops(rows, args) for rows in args.host_ops]
        for r in rows_out:
            print(" | ".join(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(rows_out, f, indent=1)
        return rows_out
    # NOTE: the engine core in this process, whatever LLM's default, so that its methods can be wrapped.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.mask_text:
        gpu_kernel_profile._serve_mask_text()
    from vllm import LLM

    cuda = args.device == "cuda"
    tmp = tempfile.mkdtemp(prefix="penalty-step-")
    model = _model_dir(args, tmp)
    max_rows = max(args.rows)
    output_len = args.settle + 2 * args.steps + 32
    llm = LLM(model, load_format="dummy", skip_tokenizer_init=True, device=args.device, dtype=args.dtype,
              max_num_seqs=max_rows,
              max_model_len=args.input_len + output_len, logprobs_mode="processed_logprobs",
              return_sampling_mask=not args.no_mask,
              max_num_batched_tokens=max(8192, args.input_len * min(max_rows, 64)))
    timer = PhaseTimer(cuda)
    handles = _instrument(llm.llm_engine.engine_core.engine_core, timer)
    all_results: list[dict[str, Any]] = []
    try:
        for rows in args.rows:
            args.rows_now = rows
            results = []
            for rnd in range(args.rounds):
                for arm in args.arms if rnd % 2 == 0 else args.arms[::-1]:
                    r = run_arm(llm, handles, timer, arm, f"{arm}-{rows}-{rnd}", args)
                    r["round"] = rnd + 1
                    results.append(r)
                    print(f"round {rnd + 1} {arm} {rows} rows: step {r['host']['step']:.2f} ms host", flush=True)
            report(rows, results)
            all_results.extend(results)
    finally:
        handles["undo"]()
        shutil.rmtree(tmp)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(all_results, f, indent=1)
    return all_results

if __name__ == "__main__":
    main()
