"""How long /health takes while hostile requests are in flight (issue 27's "/health within 100 ms").

Starts `vllm serve` on the bundled model (CPU unless --device is given), then for each attack in turn keeps three
clients sending it while this script polls /health every 20 ms for `--seconds`, and prints the latency
distribution per attack. A latency check belongs here, not in the test suite (timed tests are flaky on a loaded
machine); tests/entrypoints/test_hostile_server.py checks the same attacks for liveness and their answers.

    python tools/health_under_attack.py --seconds 6
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import threading
import time

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(REPO_ROOT, "vllm", "assets", "tiny-llama")
OK = {"max_tokens": 1, "temperature": 1.0, "top_k": 5}
MSG = [{"role": "user", "content": "hi"}]
ATTACKS: dict[str, tuple[str, dict]] = {
    "none": ("", {}),
    "heavy chat template": ("/v1/chat/completions", {
        "messages": MSG, **OK,
        "chat_template": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"}),
    "180k-character prompt": ("/v1/completions", {"prompt": "ab " * 60_000, **OK}),
    "n = 16384": ("/v1/completions", {"prompt": "hi", **OK, "n": 16384}),
    "n = 10**30": ("/v1/completions", {"prompt": "hi", **OK, "n": 10**30}),
    "body over the limit": ("/v1/completions", {"prompt": "a " * 3_000_000, **OK}),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(url: str, path: str, body: dict, seconds: float) -> tuple[list[float], list[int]]:
    stop = threading.Event()
    statuses: list[int] = []

    def attack() -> None:
        with httpx.Client(base_url=url, timeout=300) as http:
            while not stop.is_set():
                statuses.append(http.post(path, json=body).status_code)

    attackers = [threading.Thread(target=attack) for _ in range(3)] if path else []
    for t in attackers:
        t.start()
    time.sleep(0.5)  # let the attacks reach the server
    latencies: list[float] = []
    with httpx.Client(base_url=url, timeout=30) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            started = time.monotonic()
            http.get("/health").raise_for_status()
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    stop.set()
    for t in attackers:
        t.join()
    return latencies, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    port = free_port()
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", MODEL, "--port", str(port),
                             "--host", "127.0.0.1", "--device", args.device, "--uvicorn-log-level", "warning"],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        print(f"{'attack':<24} {'polls':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}  answers")
        for name, (path, body) in ATTACKS.items():
            latencies, statuses = measure(url, path, body, args.seconds)
            ms = sorted(x * 1000 for x in latencies)
            answers = ", ".join(f"{s} x{statuses.count(s)}" for s in sorted(set(statuses))) or "-"
            print(f"{name:<24} {len(ms):>5} {ms[len(ms) // 2]:>7.1f} {ms[int(len(ms) * 0.99)]:>7.1f} "
                  f"{ms[-1]:>7.1f}  {answers}", flush=True)
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
