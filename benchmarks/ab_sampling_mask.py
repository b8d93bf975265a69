"""Serving A/B of the sampling mask: "no mask" and "mask" side by side in one run.

For each arm, starts `vllm serve MODEL --load-format dummy --skip-tokenizer-init --max-num-seqs 1024
--logprobs-mode processed_logprobs --api-server-count 4 [--return-sampling-mask]` on a free port, waits for
/health, runs benchmarks/benchmark_serving.py's load at each concurrency, and stops the server. Writes
ab_sampling_mask.{json,md,png} and server_<arm>.log into --out-dir.

An arm is one of ARMS, optionally with extra environment variables for its server: `mask+VLLM_X=1` (several
`+NAME=VALUE` allowed; names must be variables of vllm/envs.py, e.g. VLLM_ATTENTION_BACKEND), to compare
settings of one arm side by side in one run; and then optionally with extra request fields:
`mask@presence_penalty=0.5@repetition_penalty=1.1` (several `@FIELD=JSON` allowed, merged into every request body
of that arm), to compare request settings, e.g. the penalties' cost: `--arms mask
mask@presence_penalty=0.5@repetition_penalty=1.1`. (The pre-change mask path is no serving arm any more: it has
no switch; its kernel cost is in benchmarks/kernels/benchmark_sampling_mask.py, its last serving numbers in
docs/benchmarks.md.)

`--paths` picks what the clients do against each arm's server (default: stream): `stream` (streamed
/v1/completions, the headline), `completions`, `chat`, `generate` (non-streamed /v1/completions,
/v1/chat/completions, /inference/v1/generate: one JSON body per request, as RL clients read them), and `offline`
(no server: benchmarks/benchmark_throughput.py, `LLM.generate` of as many requests as each concurrency, with the
arm's engine flags). Each path is a column of its own in the table and a line in the plot, named `ARM#PATH`
(`ARM` alone for stream), with its ratio to `no-mask#PATH`. Chat needs a tokenizer: its levels run against a
second server of the arm started with `--tokenizer` of a synthetic one (write_id_tokenizer: token i is the word
"<i>", so the load generator's prompts of random ids go through the chat template as those ids).

One command on the GPU machine (the server stack's wheels in /tmp/site):
    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/ab_sampling_mask.py --out-dir out/ab

Invariants:
- A server that fails to start (or dies) is recorded with the tail of its log and the next arm still runs.
- The server's whole process group (API server and engine core) is gone before the next arm starts.
- --budget-s bounds the whole run: each arm gets an equal share of the time left when it starts, spread over
  its levels through benchmark_serving's --level-timeout (a level cut short still reports tokens/s so far).
  `--arm-level-timeout ARM=S` caps one arm's levels at S seconds instead; the time it leaves goes to the arms
  after it.
- With --rounds N every arm runs N times, the arm order reversed every other round (A B, B A, ...: drift of the
  machine falls on both sides); the table shows each level's median over the rounds and the ratios of those
  medians, then every round's own ratios (arms of one round ran minutes apart, rounds further apart).
  `--arm-rounds ARM=N` runs ARM in the last N rounds only (an arm that is not the ratio's subject, so that the
  time goes to more rounds of the arms whose ratio is measured); its medians are over those rounds. Not for
  no-mask, the ratios' baseline. `--lead-arm ARM` runs ARM first in every round and alternates the others after
  it (C A B, C B A): an arm that leaves the machine slower for the next one then precedes each of them once.
- Before each arm's server starts, the host's single-thread Python speed is timed (`host_loop_ms`, ~0.2-0.4 s):
  the report lists it per round, so that a round on a slower host reads as such.
- Before the first arm, one server of that arm is started and stopped (`prime_start`, counted in --budget-s; off
  with --no-prime): on a fresh machine the first start compiles the Triton kernels and fills the caches (35-40 s
  against 15-20), which would otherwise come out of the first arm's share and cut its levels short.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchmark_serving  # noqa: E402
from ab_report import combine_rounds, markdown, plot  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = {"no-mask": ([], {}), "mask": (["--return-sampling-mask"], {}),
        # The prefix cache off (the cost of the cache on this 0%-hit workload: no-mask against it).
        "no-cache": (["--no-enable-prefix-caching"], {})}
DEFAULT_ARMS = ["no-mask", "mask"]

# NOTE: server start (imports, dummy weights, KV cache) is budgeted at this much before an arm's levels.
STARTUP_ESTIMATE_S = 60.0
# What the clients do (--paths): benchmark_serving's (endpoint, streamed) per served path; `offline` has no server.
SERVED_PATHS = {"stream": ("completions", True), "completions": ("completions", False), "chat": ("chat", False),
                "generate": ("generate", False)}
PATHS = (*SERVED_PATHS, "offline")


def result_name(arm: str, path: str) -> str:
    """The table's column of `arm` on `path`: the arm's name for the streamed path, else ARM#PATH."""
    return arm if path == "stream" else f"{arm}#{path}"


def path_groups(paths: list[str]) -> list[tuple[str, list[str]]]:
    """The runs of one arm: ("served", paths) on one server without a tokenizer, ("chat", ["chat"]) on a server
    with the synthetic tokenizer, ("offline", ["offline"]); in that order, only those asked for."""
    served = [p for p in paths if p in SERVED_PATHS and p != "chat"]
    return ([("served", served)] if served else []) + ([("chat", ["chat"])] if "chat" in paths else []) + \
        ([("offline", ["offline"])] if "offline" in paths else [])


def write_id_tokenizer(folder: str, vocab_size: int) -> str:
    """A tokenizer folder whose token i is the word "<i>" (no spaces between words), with a chat template that
    writes the messages' contents back to back: `<5><17>` is tokens [5, 17] through encode or the template, and
    every id of the model's vocabulary decodes. For chat levels of a dummy-weights model that has no tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\d+>"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"}, f)
    return folder


def model_vocab_size(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def arm_spec(arm: str) -> tuple[list[str], dict[str, str]]:
    """(vllm serve flags, extra environment) of an arm name: a key of ARMS, then optional "+VLLM_NAME=VALUE"s
    (a value may contain "+"; the names must be variables of vllm/envs.py); request fields ("@...") are
    arm_body's."""
    base, *extra = arm.partition("@")[0].split("+VLLM_")
    if base not in ARMS:
        raise ValueError(f"unknown arm {base!r} in {arm!r}; arms: {', '.join(ARMS)}, each optionally followed "
                         "by +VLLM_NAME=VALUE")
    flags, env = ARMS[base]
    env = dict(env)
    known = _env_names()
    for item in extra:
        name, sep, value = ("VLLM_" + item).partition("=")
        if not sep:
            raise ValueError(f"arm {arm!r}: expected +VLLM_NAME=VALUE, got {'+' + name!r}")
        if known is not None and name not in known:
            raise ValueError(f"arm {arm!r}: {name} is not a variable of vllm/envs.py")
        env[name] = value
    return flags, env


def arm_body(arm: str) -> dict[str, Any]:
    """The extra request fields of an arm name: its "@FIELD=JSON" parts after the first "@" ({} for none)."""
    _, sep, rest = arm.partition("@")
    body: dict[str, Any] = {}
    for item in rest.split("@") if sep else []:
        name, eq, value = item.partition("=")
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"arm {arm!r}: expected @FIELD=JSON, got {'@' + item!r}")
        try:
            body[name] = json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"arm {arm!r}: the value of @{name} is not JSON: {value!r}") from None
    return body


def _env_names() -> set[str] | None:
    try:
        from vllm import envs
    except ImportError:
        return None
    return set(envs._VARS)


def arm_file_name(arm: str) -> str:
    """The arm's name with only [A-Za-z0-9_.-] (its log and profile folder names)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", arm)


def _arm_arg(value: str) -> str:
    try:
        arm_spec(value)
        arm_body(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: str, lines: int = 25) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 20 s, and wait until the group is empty."""
    pgid = proc.pid
    for sig, grace in ((signal.SIGTERM, 20.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                proc.poll()
                return
            time.sleep(0.2)
    proc.poll()


def start_server(args: argparse.Namespace, arm: str, port: int, log_path: str,
                 tokenizer: str | None = None) -> subprocess.Popen:
    """`vllm serve` of `arm`, with --skip-tokenizer-init, or with `tokenizer` (a folder) when given."""
    flags, env_extra = arm_spec(arm)
    model = os.path.abspath(args.model) if os.path.isdir(args.model) else args.model
    tokenizer_flags = ["--skip-tokenizer-init"] if tokenizer is None else ["--tokenizer", tokenizer]
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model, "--host", "127.0.0.1",
           "--port", str(port), *tokenizer_flags, "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.max_model_len or args.input_len + args.output_len + 64),
           "--logprobs-mode", "processed_logprobs", "--uvicorn-log-level", "warning", *flags]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if args.device:
        cmd += ["--device", args.device]
    cmd += shlex.split(args.server_args)
    env = dict(os.environ)
    # NOTE: a variable that any arm of this run sets is the arms' difference: none inherits it from the shell.
    for name in {n for a in [*ARMS, *args.arms] for n in arm_spec(a)[1]}:
        env.pop(name, None)
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    log(f"{arm}: " + shlex.join([f"{k}={v}" for k, v in env_extra.items()] + ["python3", *cmd[1:]]))
    cpus = benchmark_serving.parse_cpu_list(args.server_cpus) if args.server_cpus else None
    with open(log_path, "w") as f:
        # NOTE: the server's processes (API servers, engine core) inherit the affinity set before the exec.
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus))


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with status {proc.returncode} during startup")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve was not healthy after {timeout_s:.0f}s")


def load_args(args: argparse.Namespace, url: str, concurrency: int, level_timeout: float,
              body: dict[str, Any] | None = None, path: str = "stream") -> argparse.Namespace:
    endpoint, stream = SERVED_PATHS[path]
    argv = ["--base-url", url, "--endpoint", endpoint, *([] if stream else ["--no-stream"]),
            "--concurrency", str(concurrency), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--temperature", str(args.temperature), "--top-p",
            str(args.top_p), "--top-k", str(args.top_k), "--logprobs", str(args.logprobs),
            "--num-prompts", str(max(args.min_num_prompts, round(concurrency * args.num_prompts_per_concurrency))),
            "--level-timeout", f"{level_timeout:.1f}", "--seed", str(args.seed)]
    if args.num_client_procs:
        argv += ["--num-client-procs", str(args.num_client_procs)]
    argv += ["--mask-check", args.mask_check]
    if body:
        argv += ["--extra-body", json.dumps(body)]
    if args.client_cpus:
        argv += ["--cpus", args.client_cpus]
    return benchmark_serving.make_parser().parse_args(argv)


def host_loop_ms() -> float:
    """The host's single-thread Python speed now: the best of three runs of the fixed loop that tools/gpu_run.sh's
    `info` stage times (ms; 43 and 84 ms on two H200 hosts of 2026-12-04, whose engine cores ran the same step
    ~30% apart). Taken before each arm's server starts, so that a round on a slower host can be read, not inferred."""
    return 1e3 * min(timeit.repeat("sum(i * i for i in range(1000000))", number=1, repeat=3))


def run_arm(args: argparse.Namespace, arm: str, arm_deadline: float, log_suffix: str = "",
            paths: list[str] | None = None, tokenizer: str | None = None) -> dict[str, Any]:
    """One server of `arm` and the levels of each of `paths` against it (default: stream), in path order; each
    level dict names its path (split_paths makes them columns)."""
    paths = paths or ["stream"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(args.out_dir, f"server_{arm_file_name(arm)}{log_suffix}.log")
    result: dict[str, Any] = {"arm": arm, "error": None, "levels": [], "server_log": log_path,
                              "host_loop_ms": host_loop_ms()}
    log(f"{arm}: host Python loop {result['host_loop_ms']:.1f} ms")
    t0 = time.monotonic()
    proc = start_server(args, arm, port, log_path, tokenizer)
    try:
        wait_healthy(proc, url, min(args.timeout, max(10.0, arm_deadline - time.monotonic())))
        result["startup_s"] = time.monotonic() - t0
        log(f"{arm}: healthy after {result['startup_s']:.0f}s")
        levels = [(path, c) for path in paths for c in args.concurrencies]
        for i, (path, concurrency) in enumerate(levels):
            name = result_name(arm, path)
            level_timeout = min(arm_level_timeout(args, arm), (arm_deadline - time.monotonic()) / (len(levels) - i))
            if level_timeout < 5.0:
                log(f"{name}: c={concurrency} skipped, out of time (--budget-s)")
                result["levels"].append({"concurrency": concurrency, "skipped": "out of time", "path": path})
                continue
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {proc.returncode}")
            results = benchmark_serving.run_benchmark(load_args(args, url, concurrency, level_timeout,
                                                                arm_body(arm), path),
                                                      log=lambda m, name=name: log(f"{name}: {m}"))
            result["levels"] += [{**r, "path": path} for r in results]
    except Exception as e:  # noqa: BLE001 - recorded; the next arm still runs
        result["error"] = f"{type(e).__name__}: {e}"
        result["log_tail"] = tail(log_path)
        log(f"{arm}: FAILED: {result['error']}\n{result['log_tail']}")
    finally:
        stop_server(proc)
        log(f"{arm}: server stopped ({time.monotonic() - t0:.0f}s for the arm)")
    return result


def run_offline(args: argparse.Namespace, arm: str, arm_deadline: float, log_suffix: str = "") -> dict[str, Any]:
    """The offline path of `arm`: benchmarks/benchmark_throughput.py (LLM.generate, the engine core in process)
    with the arm's engine flags and environment, one level of N requests per concurrency N."""
    flags, env_extra = arm_spec(arm)
    out = os.path.join(args.out_dir, f"offline_{arm_file_name(arm)}{log_suffix}")
    cmd = [sys.executable, os.path.join(REPO_ROOT, "benchmarks", "benchmark_throughput.py"), "--model", args.model,
           "--skip-tokenizer-init", "--max-num-seqs", str(args.max_num_seqs), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--temperature", str(args.temperature), "--top-p", str(args.top_p),
           "--top-k", str(args.top_k), "--logprobs", str(args.logprobs), "--logprobs-mode", "processed_logprobs",
           "--num-prompts", *map(str, args.concurrencies), "--json-out", out + ".json", *flags]
    if args.load_format:
        cmd += ["--load-format", args.load_format]
    if args.device:
        cmd += ["--device", args.device]
    env = {**os.environ, **env_extra, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH", "")) if p)
    result: dict[str, Any] = {"arm": arm, "error": None, "levels": [], "server_log": out + ".log",
                              "host_loop_ms": host_loop_ms()}
    if arm_body(arm):
        log(f"{arm}: offline ignores the arm's request fields {sorted(arm_body(arm))}")
    log(f"{result_name(arm, 'offline')}: " + shlex.join(["python3", *cmd[1:]]))
    try:
        with open(out + ".log", "w") as f:
            subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, check=True,
                           timeout=max(10.0, arm_deadline - time.monotonic()))
        with open(out + ".json") as f:
            rows = json.load(f)["results"]
        result["levels"] = [{"concurrency": r["num_prompts"], "path": "offline", "num_prompts": r["num_prompts"],
                             "completed": r["num_prompts"], "output_throughput": r["output_tokens_per_s"],
                             "truncated": False, "masks_ok": None if r["masks_bad"] is None else r["masks_bad"] == 0,
                             "ttft_ms_median": None, "tpot_ms_median": None} for r in rows]
    except Exception as e:  # noqa: BLE001 - recorded; the next arm still runs
        result["error"] = f"{type(e).__name__}: {e}"
        result["log_tail"] = tail(out + ".log")
        log(f"{arm}: offline FAILED: {result['error']}\n{result['log_tail']}")
    return result


def split_paths(result: dict[str, Any], paths: list[str]) -> list[dict[str, Any]]:
    """One arm run's result as one result per path of `paths` (levels by their `path`, stream when unnamed), named
    result_name(arm, path); a failed run fails each of its paths."""
    return [{**result, "arm": result_name(result["arm"], path),
             "levels": [lv for lv in result["levels"] if lv.get("path", "stream") == path]} for path in paths]


def arm_level_timeout(args: argparse.Namespace, arm: str) -> float:
    """The most seconds per level of `arm`: its --arm-level-timeout, else --level-timeout."""
    return dict(args.arm_level_timeout).get(arm, args.level_timeout)


def arm_rounds(args: argparse.Namespace, arm: str) -> int:
    """How many rounds `arm` runs: its --arm-rounds, else --rounds."""
    return dict(args.arm_rounds).get(arm, args.rounds)


def _arm_value_arg(name: str, convert: Callable[[str], Any], minimum: float) -> Callable[[str], tuple[str, Any]]:
    """An argparse type for ARM=NAME (an arm name, which may itself hold "=", then a number >= minimum)."""
    def parse(value: str) -> tuple[str, Any]:
        arm, sep, raw = value.rpartition("=")
        try:
            number = convert(raw)
        except ValueError:
            number = None
        if not sep or not arm or number is None or not number >= minimum:
            raise argparse.ArgumentTypeError(f"expected ARM={name} with {name} >= {minimum:g}, got {value!r}")
        return _arm_arg(arm), number
    return parse


_arm_rounds_arg = _arm_value_arg("ROUNDS", int, 1)
_arm_timeout_arg = _arm_value_arg("SECONDS", float, 5.0)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=os.path.join(REPO_ROOT, "benchmarks", "configs", "qwen2.5-1.5b-instruct"))
    parser.add_argument("--load-format", default="dummy", help="Passed to vllm serve; '' for the default.")
    parser.add_argument("--device", default=None, help="Passed to vllm serve (e.g. cpu for a dry run).")
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-model-len", type=int, default=None, help="Default: input + output + 64.")
    parser.add_argument("--server-args", default="--api-server-count 4",
                        help="Extra vllm serve flags (every arm), one shell-quoted string; default: 4 API server "
                             "processes, so that one Python frontend is not what the A/B measures.")
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, type=_arm_arg,
                        help=f"Arms: {', '.join(ARMS)}, each optionally with +VLLM_NAME=VALUE (extra server "
                             "environment), e.g. mask+VLLM_ATTENTION_BACKEND=TORCH.")
    parser.add_argument("--concurrencies", type=int, nargs="+", default=[64, 256, 512, 1024])
    parser.add_argument("--num-prompts-per-concurrency", type=float, default=1.0)
    parser.add_argument("--min-num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--top-k", type=int, default=512)
    parser.add_argument("--logprobs", type=int, default=1)
    parser.add_argument("--num-client-procs", type=int, default=0, help="0: benchmark_serving's default.")
    parser.add_argument("--server-cpus", default=None,
                        help="Run each arm's server (all its processes) on these CPUs only, e.g. 0-7.")
    parser.add_argument("--client-cpus", default=None,
                        help="Run the load generator's client processes on these CPUs only, e.g. 8-15.")
    parser.add_argument("--mask-check", choices=benchmark_serving.MASK_CHECKS, default="parse",
                        help="benchmark_serving's --mask-check (the load generator's cost per mask).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=240.0, help="Seconds to wait for a server's /health.")
    parser.add_argument("--level-timeout", type=float, default=90.0, help="Most seconds per concurrency level.")
    parser.add_argument("--arm-level-timeout", type=_arm_timeout_arg, action="append", default=[],
                        metavar="ARM=SECONDS", help="Most seconds per level of one arm (repeatable; overrides "
                                                    "--level-timeout for it).")
    parser.add_argument("--budget-s", type=float, default=420.0, help="Wall-time budget of the whole A/B.")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Run every arm this many times, the arm order reversed every other round; the table "
                             "reports medians over the rounds.")
    parser.add_argument("--arm-rounds", type=_arm_rounds_arg, action="append", default=[], metavar="ARM=ROUNDS",
                        help="Run one arm in the last ROUNDS rounds only (repeatable; at most --rounds; not no-mask).")
    parser.add_argument("--lead-arm", default=None,
                        help="With --rounds: run this arm (one of --arms) first in every round, the others in "
                             "alternating order after it (module docstring).")
    parser.add_argument("--no-prime", dest="prime", action="store_false",
                        help="Do not start and stop one server before the first arm (module docstring).")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=["stream"],
                        help="What the clients do against each arm (module docstring): stream, completions, chat, "
                             "generate (non-streamed), offline (LLM.generate, no server).")
    parser.add_argument("--out-dir", default="out/ab")
    return parser


def prime_start(args: argparse.Namespace, arm: str, deadline: float) -> float | None:
    """Start one server of `arm` and stop it once healthy, so that the arms' starts find warm caches; returns its
    start-up seconds, or None when it failed (logged; the arms still run)."""
    log(f"=== priming: one start of {arm}")
    t0 = time.monotonic()
    port = free_port()
    proc = start_server(args, arm, port, os.path.join(args.out_dir, "server_prime.log"))
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", min(args.timeout, max(10.0, (deadline - time.monotonic()) / 2)))
        return time.monotonic() - t0
    except Exception as e:  # noqa: BLE001 - the arms' own starts report what is wrong
        log(f"priming: {type(e).__name__}: {e}")
        return None
    finally:
        stop_server(proc)
        log(f"priming: server stopped ({time.monotonic() - t0:.0f}s)")


def round_order(arms: list[str], r: int, lead: str | None = None) -> list[str]:
    """The arms of round r (from 0): as given in even rounds, reversed in odd ones; `lead` first in every round."""
    rest = [a for a in arms if a != lead]
    return ([lead] if lead is not None else []) + (rest if r % 2 == 0 else rest[::-1])


def main() -> None:
    parser = make_parser()
    args = parser.parse_args()
    if min(args.concurrencies) < 1 or args.num_prompts_per_concurrency <= 0 or args.budget_s <= 0 or args.rounds < 1:
        parser.error("--concurrencies, --num-prompts-per-concurrency, --budget-s and --rounds must be positive.")
    for name in ("server_cpus", "client_cpus"):
        if getattr(args, name):
            try:
                benchmark_serving.parse_cpu_list(getattr(args, name))
            except ValueError as e:
                parser.error(f"--{name.replace('_', '-')}: {e}")
    for arm, _ in args.arm_level_timeout:
        if arm not in args.arms:
            parser.error(f"--arm-level-timeout: {arm!r} is not one of --arms.")
    for arm, count in args.arm_rounds:
        if arm not in args.arms:
            parser.error(f"--arm-rounds: {arm!r} is not one of --arms.")
        if count > args.rounds:
            parser.error(f"--arm-rounds: {arm}={count} is more than --rounds {args.rounds}.")
        if arm == "no-mask":
            parser.error("--arm-rounds: no-mask is the baseline of every round's ratios; it runs in every round.")
    if args.lead_arm is not None and args.lead_arm not in args.arms:
        parser.error(f"--lead-arm {args.lead_arm!r} is not one of --arms.")
    if len({arm_file_name(a) for a in args.arms}) != len(args.arms):
        parser.error("--arms: two arms would share a log file name (repeated, or differing only in characters "
                     "outside [A-Za-z0-9_.-]).")
    os.makedirs(args.out_dir, exist_ok=True)
    benchmark_serving.raise_open_files_limit()
    deadline = time.monotonic() + args.budget_s
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds: list[list[dict[str, Any]]] = []
    groups = path_groups(args.paths)
    runs_left = len(groups) * sum(arm_rounds(args, arm) for arm in args.arms)
    tokenizer = write_id_tokenizer(os.path.join(args.out_dir, "id_tokenizer"), model_vocab_size(args.model)) \
        if "chat" in args.paths else None
    served_first = bool(groups) and groups[0][0] != "offline"
    prime_s = prime_start(args, round_order(args.arms, 0, args.lead_arm)[0], deadline) \
        if args.prime and served_first else None
    names = [result_name(arm, path) for arm in args.arms for _, paths in groups for path in paths]
    for r in range(args.rounds):
        order = [arm for arm in round_order(args.arms, r, args.lead_arm) if r >= args.rounds - arm_rounds(args, arm)]
        results = []
        for arm in order:
            for kind, paths in groups:
                share = (deadline - time.monotonic()) / runs_left
                runs_left -= 1
                log(f"=== arm {arm}" + (f" ({', '.join(paths)})" if paths != ["stream"] else "")
                    + (f", round {r + 1}/{args.rounds}" if args.rounds > 1 else "") + f" ({share:.0f}s of the budget)")
                suffix = (f"_r{r + 1}" if args.rounds > 1 else "") + ("_chat" if kind == "chat" else "")
                arm_deadline = time.monotonic() + share
                if kind == "offline":
                    result = run_offline(args, arm, arm_deadline, suffix)
                elif paths == ["stream"]:
                    result = run_arm(args, arm, arm_deadline, suffix)
                else:
                    result = run_arm(args, arm, arm_deadline, suffix, paths, tokenizer if kind == "chat" else None)
                results += split_paths(result, paths)
        rounds.append(sorted(results, key=lambda a: names.index(a["arm"])))
    arms = combine_rounds(rounds)
    title = (f"{os.path.basename(args.model.rstrip('/'))}, in {args.input_len} / out {args.output_len}, "
             f"T={args.temperature} top_p={args.top_p} top_k={args.top_k} logprobs={args.logprobs}")
    table = markdown(arms, args.concurrencies, rounds)
    with open(os.path.join(args.out_dir, "ab_sampling_mask.json"), "w") as f:
        json.dump({"args": vars(args), "prime_startup_s": prime_s, "arms": arms,
                   "rounds": rounds if args.rounds > 1 else None}, f, indent=2)
    with open(os.path.join(args.out_dir, "ab_sampling_mask.md"), "w") as f:
        f.write(f"# Sampling-mask serving A/B\n\n{title}\n\n{table}\n")
    written = "json,md"
    try:
        plot(arms, args.concurrencies, os.path.join(args.out_dir, "ab_sampling_mask.png"), title)
        written += ",png"
    except Exception as e:  # noqa: BLE001 - the table and JSON are already written
        log(f"plot failed: {type(e).__name__}: {e}")
    print(table, flush=True)
    log(f"wrote {args.out_dir}/ab_sampling_mask.{{{written}}}")


if __name__ == "__main__":
    main()
