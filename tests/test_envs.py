"""vllm/envs.py holds vLLM's own variables only (issue 28: no experiment switches), every VLLM_* name the product,
its docs, tools and benchmarks mention is one of them (or vLLM's, or a placeholder), and no module of the
per-step path reads the environment."""

from __future__ import annotations

import os
import re

import pytest

from vllm import envs

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The variables vLLM itself has for the features this engine has (names and meaning as vLLM's).
VLLM_NAMES = {"VLLM_ATTENTION_BACKEND", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_SERVER_DEV_MODE",
              "VLLM_CPU_KVCACHE_SPACE", "VLLM_MAX_N_SEQUENCES"}
# Named but not read here: vLLM's own (a note on its behaviour) and placeholders in usage text.
MENTIONED = {"VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_", "VLLM_X", "VLLM_NAME", "VLLM_SERVE_ARGS"}
# The modules a step runs through: none may read a variable (a switch there is a second path in the step loop).
PER_STEP = ["vllm/v1/engine/core.py", "vllm/v1/engine/core_proc.py", "vllm/v1/engine/core_client.py",
            "vllm/v1/worker/model_runner.py", "vllm/v1/worker/async_output.py", "vllm/v1/worker/cudagraph.py",
            "vllm/v1/worker/input_prep.py", "vllm/v1/core/sched/scheduler.py", "vllm/v1/sample/sampler.py",
            "vllm/v1/sample/fast_path.py", "vllm/v1/sample/ops/topk_select.py", "vllm/v1/cuda_events.py",
            "vllm/v1/engine/output_processor.py"]
_NAME = re.compile(r"VLLM_[A-Z0-9_]*")


def _files(*roots: str) -> list[str]:
    out = []
    for root in roots:
        path = os.path.join(REPO_ROOT, root)
        if os.path.isfile(path):
            out.append(path)
            continue
        for folder, _, names in os.walk(path):
            out += [os.path.join(folder, n) for n in names if n.endswith((".py", ".md", ".sh"))]
    return out


def test_envs_holds_vllms_variables_only() -> None:
    assert set(envs._VARS) == VLLM_NAMES
    with pytest.raises(AttributeError):
        envs.VLLM_NO_SUCH_SWITCH  # noqa: B018 (a name not listed is no attribute)


def test_no_other_variable_is_named() -> None:
    found = {}
    for path in _files("vllm", "docs", "README.md", "tools", "benchmarks", "examples"):
        with open(path, encoding="utf-8", errors="replace") as f:
            for name in _NAME.findall(f.read()):
                if name not in VLLM_NAMES | MENTIONED:
                    found.setdefault(name, os.path.relpath(path, REPO_ROOT))
    assert found == {}


def test_the_pattern_finds_a_switch() -> None:
    assert _NAME.findall("set `VLLM_SOME_SWITCH=1`") == ["VLLM_SOME_SWITCH"]


@pytest.mark.parametrize("module", PER_STEP)
def test_the_per_step_path_reads_no_variable(module: str) -> None:
    path = os.path.join(REPO_ROOT, module)
    if not os.path.exists(path):
        pytest.skip(f"{module} is not in this tree")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    assert "envs." not in source and "os.environ" not in source and "getenv" not in source
