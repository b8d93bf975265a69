"""Host-side cProfile of a server process, for performance work only (VLLM_CPROFILE_DIR).

When VLLM_CPROFILE_DIR is set, the API server and the engine-core process each profile their main thread from
start-up to exit and write `<dir>/<name>.prof` (pstats) and `<dir>/<name>.txt` (the top functions by own and
by cumulative time). Off by default: cProfile slows Python code down by a large factor.
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import os
import pstats
import signal
from collections.abc import Iterator

from vllm import envs


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(0)


@contextlib.contextmanager
def maybe_cprofile(name: str, top: int = 45) -> Iterator[None]:
    out_dir = envs.VLLM_CPROFILE_DIR
    if not out_dir:
        yield
        return
    os.makedirs(out_dir, exist_ok=True)
    # NOTE: uvicorn re-raises a captured SIGTERM once it has shut down; with the default handler the process
    # would die before the stats are written.
    signal.signal(signal.SIGTERM, _exit_on_signal)
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        path = os.path.join(out_dir, name)
        prof.dump_stats(path + ".prof")
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        with open(path + ".txt", "w") as f:
            f.write(text.getvalue())
