"""The docs hold for any checkout: no Markdown file names a path of a development machine (a home folder, the
shared work tree, a virtual environment there); commands are given relative to the repository root."""

from __future__ import annotations

import glob
import os
import re

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKDOWN = sorted(p for pattern in ("*.md", "docs/*.md", "benchmarks/*.md", "tools/*.md", "tools/*/*.md",
                                     "examples/*.md")
                  for p in glob.glob(os.path.join(REPO_ROOT, pattern)))
# An absolute path into a machine's home or work folders; /models/... and /tmp/... in examples are placeholders.
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|home|root|Users)/[\w.-]+")


def test_docs_name_no_machine_path() -> None:
    assert any(p.endswith("tiny_model.md") for p in MARKDOWN)
    found = [f"{os.path.relpath(path, REPO_ROOT)}:{n}: {m.group(0)}"
             for path in MARKDOWN for n, line in enumerate(open(path, encoding="utf-8"), 1)
             for m in MACHINE_PATH.finditer(line)]
    assert found == []


def test_the_pattern_catches_what_it_is_for() -> None:
    assert MACHINE_PATH.search(". /work/venv/bin/activate && python tools/make_tiny_model.py")
    assert MACHINE_PATH.search("see /home/alice/models")
    assert not MACHINE_PATH.search("vllm serve /models/Qwen2.5-1.5B-Instruct; vllm/v1/worker/model_runner.py")
