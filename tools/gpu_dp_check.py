"""Data parallel on a machine with >= 2 GPUs (docs/parallelism.md): `vllm serve -dp 2` puts each engine core on its
own GPU, serves 64 concurrent masked streams over both (every mask holds its token, both engines count tokens
in /metrics), and the X-data-parallel-rank header pins requests to an engine. Prints one line per check and exits
non-zero when one fails.

    device run (nvidia-h100-x2, the server stack's wheels installed as tools/gpu_run.sh does):
        PYTHONPATH=/tmp/site:$PWD python3 tools/gpu_dp_check.py [--model DIR] [--load-format dummy]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time

import httpx

MODEL = "benchmarks/configs/qwen2.5-1.5b-instruct"


def engine_tokens(url: str, engine: int) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for labels, v in re.findall(r"^vllm:generation_tokens_total\{([^}]*)\} (\S+)$", text, re.M)
               if f'engine="{engine}"' in labels)


def gpu_of_pids() -> dict[int, str]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    return {int(pid): uuid.strip() for pid, uuid in (line.split(",") for line in out.splitlines() if line.strip())}


async def stream(url: str, model: str, i: int, headers: dict[str, str]) -> tuple[list[int], list[list[int]]]:
    body = {"model": model, "prompt": [5, 17, 42, 9, 300 + i], "max_tokens": 32, "temperature": 1.0,
            "top_k": 50, "top_p": 0.9, "seed": i, "ignore_eos": True, "stream": True, "return_token_ids": True}
    token_ids: list[int] = []
    masks: list[list[int]] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    token_ids += choice["token_ids"]
                    masks += choice["sampling_mask"]
    return token_ids, masks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--device", default="auto", help="cpu: a smoke run of this script (no GPU check)")
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "-dp", "2",
                               "--port", str(args.port), "--host", "127.0.0.1", "--load-format", args.load_format,
                               "--device", args.device,
                               "--skip-tokenizer-init", "--return-sampling-mask", "--logprobs-mode",
                               "processed_logprobs", "--max-model-len", "2048", "--max-num-seqs", "64"],
                              env={**os.environ})
    failures = 0

    def check(name: str, ok: bool, detail: object = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)

    try:
        deadline = time.monotonic() + 900
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                check("server started", False, f"exit code {server.returncode}")
                return 1
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        if args.device != "cpu":
            gpus = gpu_of_pids()
            children = subprocess.run(["pgrep", "-P", str(server.pid)], capture_output=True, text=True).stdout.split()
            engine_gpus = sorted({gpus[int(p)] for p in children if int(p) in gpus})
            if not engine_gpus:  # NOTE: nvidia-smi may report another PID namespace's ids: every process's GPU then
                engine_gpus = sorted(set(gpus.values()))
            check("two engine cores on two different GPUs", len(engine_gpus) == 2, engine_gpus)

        before = [engine_tokens(url, e) for e in (0, 1)]

        async def all_streams() -> list[tuple[list[int], list[list[int]]]]:
            return list(await asyncio.gather(*(stream(url, args.model, i, {}) for i in range(64))))

        results = asyncio.run(all_streams())
        aligned = all(len(t) == len(m) == 32 and all(x in mask for x, mask in zip(t, m)) for t, m in results)
        check("64 masked streams aligned (mask count == token count, each token in its mask)", aligned)
        served = [engine_tokens(url, e) - before[e] for e in (0, 1)]
        check("both engines served", min(served) > 0 and sum(served) == 64 * 32, served)

        for rank in (0, 1):
            before = [engine_tokens(url, e) for e in (0, 1)]
            asyncio.run(stream(url, args.model, 100 + rank, {"X-data-parallel-rank": str(rank)}))
            after = [engine_tokens(url, e) for e in (0, 1)]
            check(f"X-data-parallel-rank {rank} served by engine {rank}",
                  after[rank] - before[rank] == 32 and after[1 - rank] == before[1 - rank], (before, after))
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
