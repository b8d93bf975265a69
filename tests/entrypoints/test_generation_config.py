"""generation_config.json defaults (issue 26, item 5): vLLM's `get_diff_sampling_param` rules on written folders,
the flags that select them, and LLM's default SamplingParams on a copy of the bundled model with a written file."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest

from vllm.config.generation_config import diff_sampling_param
from vllm.config.model import ModelConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.sampling_params import SamplingParams

from tests.entrypoints.conftest import MODEL

GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "temperature": 0.5, "top_k": 5, "top_p": None,
                     "min_p": 0.05, "max_new_tokens": 3, "do_sample": True}


def model_copy(folder: Path, generation_config: dict | None) -> str:
    dst = folder / "model"
    shutil.copytree(MODEL, dst)
    if generation_config is not None:
        (dst / "generation_config.json").write_text(json.dumps(generation_config))
    return str(dst)


def test_auto_reads_the_model_folder(tmp_path: Path) -> None:
    folder = model_copy(tmp_path, GENERATION_CONFIG)
    # null values and keys outside vLLM's six are left out; max_new_tokens is vLLM's max_tokens
    assert diff_sampling_param(folder, "auto", None) == {"temperature": 0.5, "top_k": 5, "min_p": 0.05,
                                                         "max_tokens": 3}
    assert ModelConfig(model=folder).get_diff_sampling_param() == diff_sampling_param(folder, "auto", None)


def test_vllm_ignores_the_file_but_not_the_override(tmp_path: Path) -> None:
    folder = model_copy(tmp_path, GENERATION_CONFIG)
    assert diff_sampling_param(folder, "vllm", None) == {}
    assert diff_sampling_param(folder, "vllm", {"temperature": 0.3}) == {"temperature": 0.3}
    assert diff_sampling_param(folder, "auto", {"top_k": 9, "max_new_tokens": None}) == {
        "temperature": 0.5, "top_k": 9, "min_p": 0.05}


def test_a_folder_is_read_instead(tmp_path: Path) -> None:
    folder = model_copy(tmp_path, GENERATION_CONFIG)
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "top_p": 0.8}))
    assert diff_sampling_param(folder, str(other), None) == {"repetition_penalty": 1.1, "top_p": 0.8}
    with pytest.raises(ValueError, match="not a folder"):
        diff_sampling_param(folder, str(tmp_path / "missing"), None)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert diff_sampling_param(folder, str(empty), None) == {}


def test_bundled_model_has_no_sampling_defaults() -> None:
    assert ModelConfig(model=MODEL).get_diff_sampling_param() == {}


def test_cli_flags() -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args([MODEL, "--generation-config", "vllm", "--override-generation-config",
                              '{"temperature": 0.25}'])
    config = EngineArgs.from_cli_args(args).create_engine_config().model_config
    assert config.generation_config == "vllm" and config.get_diff_sampling_param() == {"temperature": 0.25}
    with pytest.raises(ValueError, match="JSON object"):
        EngineArgs(model=MODEL, override_generation_config="[1]").create_engine_config()


def test_load_chat_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    assert load_chat_template(None) is None


def test_llm_default_sampling_params(tmp_path: Path) -> None:
    from vllm import LLM
    folder = model_copy(tmp_path, GENERATION_CONFIG)
    llm = LLM(model=folder, device="cpu", max_model_len=128)
    try:
        defaults = llm.get_default_sampling_params()
        reference = SamplingParams(temperature=0.5, top_k=5, min_p=0.05, max_tokens=3)
        assert repr(defaults) == repr(reference)
        outputs = llm.generate(["Hello", "The sky"], use_tqdm=False)  # no SamplingParams: the defaults
        assert all(1 <= len(o.outputs[0].token_ids) <= 3 for o in outputs)
        explicit = llm.generate(["Hello"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        assert len(explicit[0].outputs[0].token_ids) == 5  # a SamplingParams given is used as it is
    finally:
        llm.llm_engine.shutdown()
    plain = LLM(model=folder, device="cpu", max_model_len=128,
                generation_config="vllm")
    try:
        assert repr(plain.get_default_sampling_params()) == repr(SamplingParams())
    finally:
        plain.llm_engine.shutdown()


def test_llm_chat_template_and_tools(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from vllm import LLM
    template_file = os.path.join(os.path.dirname(__file__), "assets", "hermes_tools.jinja")
    with open(template_file) as f:
        template = f.read()
    tools = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "hi"}]
    llm = LLM(model=MODEL, device="cpu", max_model_len=256)
    try:
        out = llm.chat(messages, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False,
                       chat_template=template, tools=tools, chat_template_kwargs={"unused": 1})[0]
    finally:
        llm.llm_engine.shutdown()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(MODEL, "tokenizer.json"))
    expected = hf.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True,
                                      add_generation_prompt=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert out.prompt_token_ids == list(expected)
