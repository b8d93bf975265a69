"""Every file in examples/ runs: each as a subprocess on the bundled tiny model (CPU unless CUDA is present), within
a time bound, exit status 0. A new example is picked up by the glob, so none can rot unseen."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = sorted(glob.glob(os.path.join(REPO_ROOT, "examples", "*.py")))
TIMEOUT_S = 300


def test_examples_exist() -> None:
    assert EXAMPLES, "no examples found"


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path: str) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, path], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{os.path.basename(path)} exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip(), "an example prints what it did"
