"""Fixtures for the scheduler tests: a config-only model folder, request/scheduler factories and a fake runner.

The fake runner mirrors what a real model runner keeps per request (token ids, computed count, block table)
from the SchedulerOutputs alone, checks them against the scheduler's own view, and samples a token that is a
deterministic function of the request's token history, so a recomputed request must reproduce its outputs.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request

VOCAB_SIZE = 1000
EOS_TOKEN_ID = 2


def history_token(req_id: str, token_ids: list[int]) -> int:
    """A pseudo-random next token that depends only on the history; never EOS."""
    h = 17
    for t in token_ids:
        h = (h * 1_000_003 + t) % 2_147_483_647
    return 3 + h % (VOCAB_SIZE - 3)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("cfg-only-model")
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB_SIZE, "max_position_embeddings": 4096,
        "hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
    }))
    return str(path)


@pytest.fixture
def make_scheduler(model_dir: str) -> Callable[..., Scheduler]:
    # NOTE: prefix caching off unless asked for: these tests' prompts share prefixes on purpose, and count the
    # tokens each step computes (test_prefix_caching.py turns it on).
    def make(max_num_seqs: int = 16, max_num_batched_tokens: int = 64, max_model_len: int = 128,
             block_size: int = 4, num_blocks: int = 1000, cls: type[Scheduler] = Scheduler,
             enable_prefix_caching: bool = False) -> Scheduler:
        config = VllmConfig(
            model_config=ModelConfig(model=model_dir, max_model_len=max_model_len),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
            scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=max_num_batched_tokens),
        )
        return cls(config, num_blocks)

    return make


def make_request(req_id: str, prompt: int | list[int], eos_token_id: int | None = EOS_TOKEN_ID,
                 **params: object) -> Request:
    prompt_ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else list(prompt)
    params.setdefault("max_tokens", 16)
    return Request(req_id, prompt_ids, SamplingParams(**params), eos_token_id)  # type: ignore[arg-type]


@dataclass
class _RunnerState:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]


@dataclass
class FakeRunner:
    """Keeps the runner's view of each request and samples with `next_token(req_id, token_ids)`."""

    scheduler: Scheduler
    next_token: Callable[[str, list[int]], int] = history_token
    states: dict[str, _RunnerState] = field(default_factory=dict)
    dropped: dict[str, list[int]] = field(default_factory=dict)
    max_batch_reqs: int = 0
    max_batch_tokens: int = 0
    num_steps: int = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        block_size = self.scheduler.block_size
        for req_id in out.finished_req_ids:
            state = self.states.pop(req_id)  # never told about a request it does not hold
            self.dropped[req_id] = state.token_ids
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.states
            token_ids = list(new.prompt_token_ids) + list(new.output_token_ids)
            if new.req_id in self.dropped:
                # A resumed request carries exactly the tokens the runner had when it dropped it.
                assert token_ids == self.dropped.pop(new.req_id)
            self.states[new.req_id] = _RunnerState(token_ids, new.num_computed_tokens, list(new.block_ids))
        cached = out.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens, strict=True):
            state = self.states[req_id]
            assert state.num_computed_tokens == num_computed
            state.block_ids.extend(new_blocks)
        # The runner holds exactly the running requests; the step computes some of them.
        assert set(self.states) == {r.request_id for r in self.scheduler.running}
        assert set(out.num_scheduled_tokens) <= set(self.states)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        self.max_batch_reqs = max(self.max_batch_reqs, len(out.num_scheduled_tokens))
        self.max_batch_tokens = max(self.max_batch_tokens, out.total_num_scheduled_tokens)

        # NOTE: rows in reverse order, so the scheduler must use req_id_to_index rather than its own order.
        req_ids = list(reversed(out.num_scheduled_tokens))
        sampled: list[list[int]] = []
        for req_id in req_ids:
            state = self.states[req_id]
            end = state.num_computed_tokens + out.num_scheduled_tokens[req_id]
            assert 0 < end <= len(state.token_ids)
            assert len(state.block_ids) == -(end // -block_size)
            assert state.block_ids == self.scheduler.kv_cache_manager.get_block_ids(req_id)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                token = self.next_token(req_id, state.token_ids)
                state.token_ids.append(token)
                sampled.append([token])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled)

    def step(self) -> tuple[SchedulerOutput, EngineCoreOutputs]:
        self.num_steps += 1
        assert self.num_steps <= 1000, "requests make no progress"
        out = self.scheduler.schedule()
        return out, self.scheduler.update_from_output(out, self.execute(out))

    def run_to_completion(self) -> dict[str, list[int]]:
        """Step until nothing is left; returns each request's concatenated new tokens."""
        tokens: dict[str, list[int]] = {}
        while self.scheduler.has_requests():
            _, outs = self.step()
            for o in outs.outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        return tokens


@pytest.fixture
def fake_runner() -> type[FakeRunner]:
    return FakeRunner


@pytest.fixture
def request_factory() -> Callable[..., Request]:
    return make_request


def _reference_tokens(req: Request, num_tokens: int) -> list[int]:
    """What an unbatched, never-preempted run with `history_token` generates."""
    token_ids = list(req.prompt_token_ids)
    for _ in range(num_tokens):
        token_ids.append(history_token(req.request_id, token_ids))
    return token_ids[req.num_prompt_tokens:]


@pytest.fixture
def reference_tokens() -> Callable[[Request, int], list[int]]:
    return _reference_tokens
