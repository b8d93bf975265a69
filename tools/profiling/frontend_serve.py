"""The API servers under real HTTP load, without a device: `vllm serve` whose engine core replays decode steps.

What it measures: the whole of an API server's work per streamed token, as it runs on the GPU machine and the
in-process harness (frontend_step.py) cannot see it: the ZMQ receive, the HTTP intake of each request, the
sockets' system calls, the event loop's wake-ups, the garbage collector. Each arm starts this script in `serve`
mode, which is `vllm serve` (the same flags, `--api-server-count N` API server processes, the real engine-core
process and its scheduler and output path) with one change: the engine core's worker is `_ReplayWorker`, which
returns each scheduled step's output without a model (one random token per row, logprobs, and with
`--return-sampling-mask` a mask of `--mask-size` ids per row, as JSON text when the API servers take text),
paced like a device: a step takes at least `--device-ms + --device-ms-per-row * rows` (defaults: the H200's
steady no-mask decode steps of the A/B model, 4.5 ms at 256 rows and 12.5 at 1024). Then one load level of
benchmarks/benchmark_serving.py (the A/B's sampling settings), and the CPU time of each server process over the
level from /proc: per API server its share of a core and its CPU microseconds per streamed token (user and
system), and the engine core's.

    python tools/profiling/frontend_serve.py --arms no-mask mask --concurrency 128 --duration 20 \\
        [--trees /tmp/old .] [--rounds 2] [--json-out out.json]

`--trees` compares code: each arm runs with each tree's `vllm` (PYTHONPATH=TREE; this script, the replay core
and the load generator stay this tree's), tree order A B, B A, ... per round. Numbers are for comparing arms
and trees on one machine in one run; the load generator and the server share its CPUs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections import deque
from typing import Any

import numpy as np

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import EngineCore
from vllm.v1.executor.uniproc_executor import UniProcExecutor
from vllm.v1.outputs import LogprobsLists, ModelRunnerOutput, SamplingMaskLists, SamplingMaskText
from vllm.v1.sample.sampling_mask import group_order

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))  # benchmark_serving, the load generator
MODEL_DIR = os.path.join(REPO_ROOT, "benchmarks", "configs", "qwen2.5-1.5b-instruct")
ARMS = {"no-mask": [], "mask": ["--return-sampling-mask"]}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------------------
# The replay engine core (runs in the engine-core process of `serve` mode).

class _ReplayWorker:
    """Each scheduled step's ModelRunnerOutput without a model, paced like a device (module docstring)."""

    def __init__(self, vllm_config: Any, scheduler: Any, device_ms: float, device_ms_per_row: float,
                 mask_size: int, seed: int = 0) -> None:
        model_config = vllm_config.model_config
        rows = vllm_config.scheduler_config.max_num_seqs
        vocab = model_config.vocab_size
        rng = np.random.default_rng(seed)
        self.scheduler = scheduler
        self.device_s = device_ms / 1e3
        self.device_s_per_row = device_ms_per_row / 1e3
        self.next_free = 0.0
        self.tokens = rng.integers(3, vocab, rows).tolist()
        cols = model_config.max_logprobs + 1
        self.lp_ids = rng.integers(3, vocab, (rows, cols)).astype(np.int32)
        self.lp_ids[:, 0] = self.tokens
        self.lp_values = np.sort(-rng.random((rows, cols), dtype=np.float32) * 5, axis=1)[:, ::-1].copy()
        self.lp_ranks = np.ones(rows, dtype=np.int32)
        self.masks = model_config.return_sampling_mask
        self.mask_text = self.masks and model_config.sampling_mask_text
        ids = np.sort(rng.choice(vocab, mask_size, replace=False)).astype(np.int32)
        # NOTE: every row the same support: an API server's cost depends on the sizes, not on the ids.
        self.mask_ids = np.tile(ids, rows)
        self.mask_offsets = np.arange(rows + 1, dtype=np.int64) * mask_size
        row_text = ("[" + ",".join(map(str, ids.tolist())) + "]").encode()
        self.text = np.frombuffer(row_text * rows, dtype=np.uint8)
        self.text_offsets = np.arange(rows + 1, dtype=np.int64) * len(row_text)

    def execute_model(self, scheduler_output: Any) -> Any:
        req_ids = list(scheduler_output.num_scheduled_tokens)
        n = len(req_ids)
        requests = self.scheduler.requests
        reqs = [requests[r] for r in req_ids]
        # NOTE: every row samples; the scheduler discards what a partial prefill's row sampled, as with a model.
        sampled = [[t] for t in self.tokens[:n]]
        num_logprobs = max((r.sampling_params.logprobs or 0 for r in reqs if r.wants_logprobs), default=-1)
        logprobs = masks = texts = None
        if num_logprobs >= 0:
            cols = num_logprobs + 1
            logprobs = LogprobsLists(self.lp_ids[:n, :cols], self.lp_values[:n, :cols], self.lp_ranks[:n], None)
        if self.masks and n:
            offsets = self.mask_offsets[:n + 1]
            if self.mask_text:
                # The ids stay on the device; the text packed by API server, as json_rows_packed writes it.
                rank = group_order(np.fromiter((r.client_index for r in reqs), dtype=np.int64, count=n))[1]
                texts = SamplingMaskText(self.text[:self.text_offsets[n]], self.text_offsets[:n + 1], None, rank)
                masks = SamplingMaskLists(None, offsets, None)
            else:
                masks = SamplingMaskLists(self.mask_ids[:offsets[n]], offsets, None)
        # Paced: the step is done no earlier than the device would have finished it after the previous one.
        now = time.perf_counter()
        done = max(now, self.next_free) + self.device_s + self.device_s_per_row * n
        self.next_free = done
        if done > now:
            time.sleep(done - now)
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, logprobs=logprobs, sampling_masks=masks,
                                 sampling_mask_text=texts)


def replay_core(vllm_config: Any, device_ms: float, device_ms_per_row: float, mask_size: int) -> Any:
    """The engine core of `serve` mode: EngineCore's scheduler, queue and step loop (synchronous scheduling) over
    a _ReplayWorker."""

    class ReplayCore(EngineCore):
        def __init__(self) -> None:  # noqa: super().__init__ would build a Worker and load a model
            self.vllm_config = vllm_config
            block_size = vllm_config.cache_config.block_size
            max_len = vllm_config.model_config.max_model_len
            self.num_gpu_blocks = vllm_config.scheduler_config.max_num_seqs * (-(-max_len // block_size) + 1)
            self.async_scheduling = False
            self.scheduler = Scheduler(vllm_config, self.num_gpu_blocks)
            self.batch_queue = deque()
            self.worker = _ReplayWorker(vllm_config, self.scheduler, device_ms, device_ms_per_row, mask_size)
            # NOTE: the one-rank executor over the replay worker, without building a real one.
            self.model_executor = UniProcExecutor.__new__(UniProcExecutor)
            self.model_executor.driver_worker = self.worker
            self._init_lifecycle()

    return ReplayCore()


def serve(argv: list[str]) -> int:
    """`vllm serve` with the replay engine core: `serve --device-ms X --device-ms-per-row Y --mask-size N --
    VLLM_SERVE_ARGS...`."""
    import logging
    from vllm.entrypoints.cli.main import make_parser
    from vllm.entrypoints.openai import api_server_group
    from vllm.v1.engine import core_launch

    split = argv.index("--")
    own = argparse.ArgumentParser()
    own.add_argument("--device-ms", type=float, required=True)
    own.add_argument("--device-ms-per-row", type=float, required=True)
    own.add_argument("--mask-size", type=int, required=True)
    ours, rest = own.parse_args(argv[:split]), argv[split + 1:]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    args = make_parser().parse_args(["serve", *rest])
    factory = functools.partial(replay_core, device_ms=ours.device_ms, device_ms_per_row=ours.device_ms_per_row,
                                mask_size=ours.mask_size)
    # NOTE: run_api_servers launches its cores through this module attribute; any --api-server-count (1 too) takes
    # that path, so every arm's servers are separate processes, as with 4 on the GPU machine.
    api_server_group.launch_engine_cores = functools.partial(core_launch.launch_engine_cores,
                                                             engine_core_factory=factory)
    return api_server_group.run_api_servers(args)


# ---------------------------------------------------------------------------------------------------------------
# The driver.

def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def proc_cpu(pid: int) -> tuple[float, float] | None:
    """(user, system) CPU seconds of a process so far, None when it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK)


def group_pids(pgid: int) -> list[int]:
    """The processes of a process group, the resource tracker of multiprocessing left out."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields is None or int(fields[2]) != pgid:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except OSError:
            continue
        pids.append(int(entry))
    return sorted(pids)


def core_pid(log_path: str) -> int | None:
    """The (first) engine core's pid, from the launcher's start-up line ("... engine core(s) (pids 123, 124) ...")."""
    with open(log_path, errors="replace") as f:
        m = re.search(r"engine core\(s\) \(pids (\d+)", f.read())
    return int(m.group(1)) if m else None


def server_cmd(args: argparse.Namespace, arm: str, port: int) -> list[str]:
    max_len = args.input_len + args.output_len + 64
    return [sys.executable, os.path.abspath(__file__), "serve", "--device-ms", str(args.device_ms),
            "--device-ms-per-row", str(args.device_ms_per_row), "--mask-size", str(args.mask_size), "--",
            MODEL_DIR, "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
            "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(max_len),
            "--logprobs-mode", "processed_logprobs", "--uvicorn-log-level", "warning",
            "--api-server-count", str(args.api_server_count), *ARMS[arm], *shlex.split(args.server_args)]


def run_one(args: argparse.Namespace, tree: str, arm: str, tag: str) -> dict[str, Any]:
    import benchmark_serving
    from ab_sampling_mask import free_port, stop_server, tail, wait_healthy
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.out_dir, f"server_{tag}.log")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(tree), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    result: dict[str, Any] = {"tree": tree, "arm": arm, "error": None}
    with open(log_path, "w") as f:
        proc = subprocess.Popen(server_cmd(args, arm, port), cwd=REPO_ROOT, env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, url, args.timeout)
        core = core_pid(log_path)
        load = ["--base-url", url, "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                "--temperature", "1", "--top-p", "0.95", "--top-k", "512", "--logprobs", "1", "--seed", "0",
                "--mask-check", "count", "--num-client-procs", str(args.num_client_procs)]
        # A short level first: connections, the servers' first requests, the allocator's pools.
        warm = benchmark_serving.make_parser().parse_args(
            load + ["--concurrency", str(args.concurrency), "--num-prompts", str(args.concurrency),
                    "--level-timeout", str(args.warmup_s), "--num-warmups", "0"])
        benchmark_serving.run_benchmark(warm, log=lambda m: None)
        pids = [p for p in group_pids(proc.pid) if p != proc.pid]
        spies = []
        if args.py_spy is not None:
            # py-spy (pip install py-spy) samples each API server during the level: stacks in collapsed form. It
            # stops the process for each sample: --nonblocking reads it running, which misplaced samples here (a
            # zmq send at 13% of the samples, 3% when stopped).
            for p in pids:
                if p != core:
                    out = os.path.join(args.out_dir, f"pyspy_{tag}_{p}.txt")
                    spies.append(subprocess.Popen(
                        [py_spy_path(), "record", "--pid", str(p), "--duration", str(int(args.duration)), "--rate",
                         "250", "--format", "raw", "--output", out, *shlex.split(args.py_spy)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        before = {p: proc_cpu(p) for p in pids}
        t0 = time.monotonic()
        level = benchmark_serving.make_parser().parse_args(
            load + ["--concurrency", str(args.concurrency), "--num-prompts", str(args.concurrency * 1000),
                    "--level-timeout", str(args.duration), "--num-warmups", "0"])
        summary = benchmark_serving.run_benchmark(level, log=lambda m: None)[0]
        wall = time.monotonic() - t0
        after = {p: proc_cpu(p) for p in pids}
        for spy in spies:
            spy.wait(30)
        tokens = summary["output_tokens"]
        # NOTE: the CPU over the level's own span (the load generator's start-up is idle time for the server).
        span = min(wall, summary["duration_s"])
        procs = []
        for p in pids:
            if before[p] is None or after[p] is None:
                continue
            user, system = (after[p][0] - before[p][0]), (after[p][1] - before[p][1])
            procs.append({"pid": p, "role": "engine core" if p == core else "API server",
                          "cpu_pct": 100 * (user + system) / span, "sys_pct": 100 * system / span,
                          "us_per_token": 1e6 * (user + system) / max(tokens, 1),
                          "sys_us_per_token": 1e6 * system / max(tokens, 1)})
        api = [p for p in procs if p["role"] == "API server"]
        result.update(summary={k: summary.get(k) for k in ("output_throughput", "output_tokens", "duration_s",
                                                           "ttft_ms_median", "tpot_ms_median", "failed", "masks_ok",
                                                           "mean_mask_size")},
                      procs=procs, api_us_per_token=sum(p["us_per_token"] for p in api),
                      api_sys_us_per_token=sum(p["sys_us_per_token"] for p in api))
    except Exception as e:  # noqa: BLE001 - recorded; the next run still goes
        result["error"] = f"{type(e).__name__}: {e}"
        result["log_tail"] = tail(log_path)
    finally:
        stop_server(proc)
    return result


def py_spy_path() -> str:
    here = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return here if os.path.exists(here) else (shutil.which("py-spy") or "py-spy")


def stack_summary(path: str, top: int = 25) -> str:
    """The busiest functions of a py-spy raw (collapsed) profile: share of the samples where each is the leaf
    (self) and where it is on the stack (inclusive)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    with open(path) as f:
        for row in f:
            stack, _, count = row.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            own[frames[-1]] = own.get(frames[-1], 0) + n
            for frame in set(frames):
                inclusive[frame] = inclusive.get(frame, 0) + n
    rows = [f"{total} samples; self %, inclusive %, function"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"{100 * n / total:6.2f} {100 * inclusive[frame] / total:6.2f}  {frame}")
    rows.append("inclusive only:")
    for frame, n in sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]:
        rows.append(f"       {100 * n / total:6.2f}  {frame}")
    return "\n".join(rows)


def line(r: dict[str, Any]) -> str:
    if r["error"]:
        return f"{r['tree']} {r['arm']}: FAILED {r['error']}\n{r.get('log_tail', '')}"
    s = r["summary"]
    api = [p for p in r["procs"] if p["role"] == "API server"]
    core = [p for p in r["procs"] if p["role"] == "engine core"]
    return (f"{r['tree']} {r['arm']}: {s['output_throughput']:,.0f} tok/s, TTFT {s['ttft_ms_median'] or 0:.0f} ms,"
            f" TPOT {s['tpot_ms_median'] or 0:.1f} ms; API servers {r['api_us_per_token']:.1f} us/token"
            f" (sys {r['api_sys_us_per_token']:.1f}), " + ", ".join(f"{p['cpu_pct']:.0f}%" for p in api)
            + (f" of a core; engine core {core[0]['cpu_pct']:.0f}% ({core[0]['us_per_token']:.1f} us/token)"
               if core else "") + ("" if s["masks_ok"] is None else f"; masks {'ok' if s['masks_ok'] else 'BAD'}"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--trees", nargs="+", default=[REPO_ROOT],
                        help="Folders whose vllm package each run imports (PYTHONPATH).")
    parser.add_argument("--rounds", type=int, default=1, help="Each (tree, arm) this many times, the order "
                        "reversed every other round.")
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--duration", type=float, default=20.0, help="Seconds of the measured level.")
    parser.add_argument("--warmup-s", type=float, default=4.0)
    parser.add_argument("--api-server-count", type=int, default=1)
    parser.add_argument("--num-client-procs", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--device-ms", type=float, default=1.83)
    parser.add_argument("--device-ms-per-row", type=float, default=0.0104)
    parser.add_argument("--mask-size", type=int, default=506, help="Ids per mask (the A/B's mean at top_k 512, "
                        "top_p 0.95).")
    parser.add_argument("--server-args", default="", help="More `vllm serve` flags, one string.")
    parser.add_argument("--timeout", type=float, default=120.0, help="Seconds for a server to become healthy.")
    parser.add_argument("--py-spy", default=None, metavar="FLAGS", help="Sample each API server with py-spy "
                        "during the level (extra py-spy flags, e.g. '--native', or ''): pyspy_*.txt in --out-dir.")
    parser.add_argument("--out-dir", default="frontend_serve_out")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    os.makedirs(args.out_dir, exist_ok=True)
    runs = [(t, a) for t in args.trees for a in args.arms]
    results = []
    for rnd in range(args.rounds):
        for i, (tree, arm) in enumerate(runs if rnd % 2 == 0 else runs[::-1]):
            tag = f"r{rnd}-{i}-{os.path.basename(os.path.abspath(tree))}-{arm}"
            result = run_one(args, tree, arm, tag)
            result["round"] = rnd
            results.append(result)
            print(f"[{time.strftime('%H:%M:%S')}] round {rnd + 1}: {line(result)}", flush=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 1 if any(r["error"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
