"""vLLM names and arguments that RL frameworks use (verl, OpenRLHF, SkyRL, NeMo-RL): vllm.inputs prompts,
(Async)EngineArgs, AsyncLLMEngine / LLMEngine, reset_prefix_cache, is_sleeping, the accepted-but-ignored engine
arguments and the refused values. One LLM (engine core in this process) and one AsyncLLM (its own process)."""

from __future__ import annotations

import asyncio
import logging
import re
import subprocess
import sys

import pytest

import vllm
from vllm import LLM, AsyncEngineArgs, AsyncLLMEngine, EngineArgs, SamplingParams, TextPrompt, TokensPrompt
from vllm.entrypoints.cli.main import make_parser, serve
from vllm.outputs import RequestOutput
from vllm.utils import random_uuid
from vllm.v1.engine.async_llm import AsyncLLM

PROMPT_IDS = [5, 17, 42, 9]
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm() -> LLM:
    # NOTE: every accepted compatibility argument at once: none may change what the engine generates.
    return LLM(device="cpu", max_num_seqs=8, max_model_len=128, trust_remote_code=True, enable_prefix_caching=True,
               enable_chunked_prefill=True, disable_log_stats=True, distributed_executor_backend="uni")


@pytest.fixture
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget which one-time warnings this process has already logged."""
    monkeypatch.setattr("vllm.utils._warned", set())


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ---------------------------------------------------------------------------------------------- import and names

def test_import_vllm_stays_light_and_names_resolve() -> None:
    code = ("import sys, vllm; assert 'torch' not in sys.modules, 'import vllm pulled torch'; "
            "from vllm import TokensPrompt, TextPrompt; assert 'torch' not in sys.modules; "
            "from vllm import AsyncLLMEngine, LLMEngine, EngineArgs, AsyncEngineArgs; print(AsyncLLMEngine.__name__, "
            "LLMEngine.__module__, EngineArgs.__name__, AsyncEngineArgs.__mro__[1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["AsyncLLM", "vllm.v1.engine.llm_engine", "EngineArgs", "EngineArgs"]
    from vllm.engine.async_llm_engine import AsyncLLMEngine as FromEngine
    from vllm.engine.llm_engine import LLMEngine as FromEnginePath
    from vllm.v1.engine.llm_engine import LLMEngine
    assert FromEngine is AsyncLLMEngine is AsyncLLM and FromEnginePath is LLMEngine is vllm.LLMEngine


def test_random_uuid() -> None:
    a, b = random_uuid(), random_uuid()
    assert re.fullmatch(r"[0-9a-f]{32}", a) and a != b


# --------------------------------------------------------------------------------------- engine arguments (config)

@pytest.mark.parametrize("kwargs, match", [
    ({"distributed_executor_backend": "external_launcher"},
     r"distributed_executor_backend='external_launcher' is not supported: this engine starts its own workers; use "
     r"'mp' \(one node\) or 'ray'\."),
    ({"distributed_executor_backend": "uni", "tensor_parallel_size": 2},
     r"distributed_executor_backend='uni' runs one worker, but tensor_parallel_size=2 needs 2; use 'mp' or 'ray'\."),
    ({"tensor_parallel_size": 3}, r"tensor_parallel_size=3 cannot split .*num_attention_heads=4 is not divisible by it"),
    ({"tensor_parallel_size": 0}, r"tensor_parallel_size must be a positive integer, got 0\."),
    ({"pipeline_parallel_size": 2}, r"pipeline_parallel_size=2 is not supported: .*--pipeline-parallel-size 1\."),
    ({"enable_expert_parallel": True}, r"enable_expert_parallel=True is not supported: .*enable_expert_parallel=False"),
    ({"enable_lora": True}, r"enable_lora=True is not supported: this engine has no LoRA; use enable_lora=False"),
])
def test_refused_engine_args(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(device="cpu", **kwargs).create_engine_config()
    with pytest.raises(ValueError, match=match):  # LLM(...) refuses them before starting anything
        LLM(device="cpu", **kwargs)


@pytest.mark.parametrize("backend, tp, resolved", [(None, 1, "uni"), ("uni", 1, "uni"), ("mp", 1, "mp"),
                                                   ("ray", 1, "ray"), (None, 2, "mp"), ("ray", 4, "ray")])
def test_accepted_executor_backends(backend: str | None, tp: int, resolved: str) -> None:
    """vLLM's defaulting: None is uni for one rank, mp for several."""
    config = EngineArgs(device="cpu", distributed_executor_backend=backend,
                        tensor_parallel_size=tp).create_engine_config()
    assert config.parallel_config.distributed_executor_backend == resolved


def test_ignored_args_warn_once(fresh_warnings: None, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    for _ in range(2):
        EngineArgs(device="cpu", enable_prefix_caching=True, enable_chunked_prefill=False,
                   trust_remote_code=True).create_engine_config()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # enable_prefix_caching is honoured now (tests/v1/e2e/test_prefix_caching_e2e.py): no warning.
    assert len(messages) == 1
    assert messages[0].startswith("enable_chunked_prefill=False: this engine always chunks prefills")
    caplog.clear()
    EngineArgs(device="cpu", enable_prefix_caching=False, enable_chunked_prefill=True).create_engine_config()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    parser = make_parser()
    args = parser.parse_args(["serve", "--device", "cpu", "--enable-prefix-caching", "--enable-chunked-prefill",
                              "--trust-remote-code", "--distributed-executor-backend", "mp", "--disable-log-stats",
                              "--enable-log-requests"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert (engine_args.enable_prefix_caching, engine_args.enable_chunked_prefill, engine_args.trust_remote_code,
            engine_args.distributed_executor_backend, engine_args.disable_log_stats,
            engine_args.enable_log_requests) == (True, True, True, "mp", True, True)
    defaults = AsyncEngineArgs.from_cli_args(parser.parse_args(["serve"]))
    assert defaults == AsyncEngineArgs()
    # A refused value stops `vllm serve` with status 2 and the message, before any engine starts.
    args = parser.parse_args(["serve", "--device", "cpu", "--distributed-executor-backend", "external_launcher"])
    with pytest.raises(SystemExit) as exc:
        serve(args, parser)
    assert exc.value.code == 2
    assert "distributed_executor_backend='external_launcher' is not supported" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- offline: LLM, LLMEngine

def test_typed_prompts_generate_as_plain_ones(llm: LLM) -> None:
    typed = llm.generate([TokensPrompt(prompt_token_ids=PROMPT_IDS), TextPrompt(prompt="The function")], SEEDED,
                         use_tqdm=False)
    plain = llm.generate([{"prompt_token_ids": PROMPT_IDS}, "The function"], SEEDED, use_tqdm=False)
    assert token_ids(typed) == token_ids(plain)
    assert all(len(t) == 12 for t in token_ids(typed))
    assert typed[1].prompt == "The function" and typed[0].prompt_token_ids == PROMPT_IDS


def test_refused_requests_leave_the_engine_as_it_was(llm: LLM) -> None:
    ref = token_ids(llm.generate([{"prompt_token_ids": PROMPT_IDS}], GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match=r"Unsupported prompt key\(s\): 'multi_modal_data'"):
        llm.generate([{"prompt_token_ids": PROMPT_IDS}, {"prompt": "x", "multi_modal_data": {"image": None}}],
                     GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_request is not supported: this engine has no LoRA"):
        llm.generate([{"prompt_token_ids": PROMPT_IDS}], GREEDY, use_tqdm=False, lora_request=object())
    with pytest.raises(ValueError, match=r"priority=\[0, 2\] is not supported: .*pass priority=None\."):
        llm.generate([{"prompt_token_ids": PROMPT_IDS}] * 2, GREEDY, use_tqdm=False, priority=[0, 2])
    assert token_ids(llm.generate([{"prompt_token_ids": PROMPT_IDS}], GREEDY, use_tqdm=False, priority=[0])) == ref
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="lora_request is not supported"):
        engine.add_request("x", {"prompt_token_ids": PROMPT_IDS}, GREEDY, lora_request=object())
    with pytest.raises(ValueError, match=r"priority=3 is not supported: .*pass priority=0\."):
        engine.add_request("x", {"prompt_token_ids": PROMPT_IDS}, GREEDY, priority=3)
    assert not engine.has_unfinished_requests()
    assert token_ids(llm.generate([{"prompt_token_ids": PROMPT_IDS}], GREEDY, use_tqdm=False)) == ref


def test_reset_prefix_cache_and_model_config(llm: LLM) -> None:
    prompts = [{"prompt_token_ids": PROMPT_IDS}, "The function"]
    before = token_ids(llm.generate(prompts, SEEDED, use_tqdm=False))
    assert llm.reset_prefix_cache() is True
    assert llm.llm_engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert token_ids(llm.generate(prompts, SEEDED, use_tqdm=False)) == before
    assert llm.llm_engine.model_config.max_model_len == 128
    assert llm.llm_engine.model_config is llm.llm_engine.vllm_config.model_config


def test_llm_engine_from_engine_args_vllm_signature(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's LLMEngine.from_engine_args(engine_args, usage_context, stat_loggers, enable_multiprocessing): the
    core in its own process when asked, generating what the in-process engine of the `llm` fixture does."""
    from vllm import LLMEngine

    monkeypatch.setattr("vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING", False)
    with pytest.raises(ValueError, match=r"stat_loggers is not supported: .*pass stat_loggers=None\."):
        LLMEngine.from_engine_args(EngineArgs(device="cpu"), None, {"x": object()})
    engine = LLMEngine.from_engine_args(EngineArgs(device="cpu", max_num_seqs=8, max_model_len=128),
                                        usage_context="ENGINE_CONTEXT", enable_multiprocessing=True)
    try:
        assert engine.multiprocess_mode is True
        engine.add_request("a", {"prompt_token_ids": PROMPT_IDS}, GREEDY)
        done = []
        while engine.has_unfinished_requests():
            done += [o for o in engine.step() if o.finished]
    finally:
        engine.shutdown()
    assert token_ids(done) == token_ids(llm.generate([{"prompt_token_ids": PROMPT_IDS}], GREEDY, use_tqdm=False))


# ------------------------------------------------------------------------------------------------- AsyncLLMEngine

def test_stat_loggers_refused() -> None:
    match = r"stat_loggers is not supported: custom stat loggers cannot be added .*pass stat_loggers=None\."
    with pytest.raises(ValueError, match=match):
        AsyncLLMEngine.from_engine_args(AsyncEngineArgs(device="cpu"), stat_loggers={"x": object()})
    with pytest.raises(ValueError, match=match):
        AsyncLLMEngine.from_vllm_config(EngineArgs(device="cpu").create_engine_config(), stat_loggers=[])


def test_async_llm_engine_from_engine_args(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="vllm.v1.engine.async_llm")

    async def final(engine: AsyncLLM, prompt: object, request_id: str, **kwargs: object) -> list[int]:
        out = None
        async for out in engine.generate(prompt, SEEDED, request_id, **kwargs):  # type: ignore[arg-type]
            pass
        assert out is not None and out.finished
        return out.outputs[0].token_ids

    async def run() -> None:
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
            device="cpu", max_num_seqs=4, max_model_len=128, enable_log_requests=True, disable_log_stats=True))
        try:
            assert await engine.is_sleeping() is False
            typed = await final(engine, TokensPrompt(prompt_token_ids=PROMPT_IDS), "typed")
            plain = await final(engine, {"prompt_token_ids": PROMPT_IDS}, "plain", lora_request=None, priority=0)
            assert typed == plain and len(typed) == 12
            with pytest.raises(ValueError, match="lora_request is not supported: this engine has no LoRA"):
                await final(engine, {"prompt_token_ids": PROMPT_IDS}, "lora", lora_request=object())
            with pytest.raises(ValueError, match=r"priority=1 is not supported: requests are scheduled first come"):
                await final(engine, {"prompt_token_ids": PROMPT_IDS}, "prio", priority=1)
            # verl sends TokensPrompt(..., multi_modal_data={}) with every text request: it asks for nothing.
            assert await final(engine, TokensPrompt(prompt_token_ids=PROMPT_IDS, multi_modal_data={}), "mm") == typed
            with pytest.raises(ValueError, match=r"Unsupported prompt key\(s\): 'multi_modal_data'"):
                await final(engine, {"prompt_token_ids": PROMPT_IDS, "multi_modal_data": {"image": [1]}}, "mm2")
            assert await engine.reset_prefix_cache() is True
            assert await engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
            assert await final(engine, {"prompt_token_ids": PROMPT_IDS}, "after") == typed
            # disable_log_stats: nothing was recorded.
            assert re.search(r"^vllm:prompt_tokens_total\{[^}]*\} 0\.0$", engine.stat_logger.render().decode(),
                             re.MULTILINE)
        finally:
            engine.shutdown()

    asyncio.run(run())
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Added request")]
    assert [m.split(":")[0] for m in logged] == ["Added request typed", "Added request plain", "Added request mm",
                                                  "Added request after"]
    assert "4 prompt tokens" in logged[0] and "seed=1234" in logged[0]
