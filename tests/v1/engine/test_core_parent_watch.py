"""The engine core's parent watch (core_proc._watch_parent): when the parent process is gone, the core gets
SIGTERM, and a core whose main thread cannot act on it (stuck in a collective; here SIGTERM is ignored, which
looks the same from outside) still ends, by os._exit(1), once the grace has passed. The process tree is built by
hand: this test -> parent (killed) -> core (runs the real _watch_parent)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

_CORE = """
import signal, sys, time
import vllm.v1.engine.core_proc as core_proc
core_proc._PARENT_EXIT_GRACE_S = 1.0
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a main thread that never acts on SIGTERM
core_proc._watch_parent(int(sys.argv[1]))
print("ready", flush=True)
while True:
    time.sleep(60)
"""

_PARENT = """
import os, subprocess, sys
core = subprocess.Popen([sys.executable, "-c", sys.argv[1], str(os.getpid())], stdout=subprocess.PIPE, text=True)
assert core.stdout.readline().strip() == "ready"
print(core.pid, flush=True)
import time
while True:
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_core_ends_after_grace_when_parent_dies_and_sigterm_does_nothing() -> None:
    env = {**os.environ, "PYTHONPATH": _REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CORE], stdout=subprocess.PIPE, text=True, env=env)
    core_pid = 0
    try:
        core_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        assert _alive(core_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(core_pid), "the engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
        if core_pid and _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)
