"""A worker extension that imports in the frontend and the engine core but not in a spawned tensor-parallel worker
process (the start-up failure test: a rank that fails before joining its group)."""

from __future__ import annotations

import multiprocessing

if multiprocessing.current_process().name.startswith("VllmWorker"):
    raise ImportError("this extension does not import in a worker process (test)")


class Extension:
    def hello(self) -> str:
        return "hello"
