"""distributed_executor_backend="ray" on a local Ray instance (CPU, gloo): rank 1 is a Ray actor of a placement
group; TP=2 greedy tokens and seeded tokens and masks equal a TP=1 engine's (itself started with the ray backend,
which one rank accepts), and collective_rpc answers once per
rank in rank order; a killed actor process gives EngineDeadError. One engine for the module (Ray's start-up is
the cost); skipped without Ray installed."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
from rl_worker_ext import rank_and_double, worker_pid

from vllm import LLM, SamplingParams
from vllm.v1.engine.core_client import EngineDeadError

pytest.importorskip("ray")

PROMPTS = [{"prompt_token_ids": [5, 17, 42, 9, 300, 12]}, {"prompt_token_ids": list(range(40, 90))}]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, return_sampling_mask=False)
SEEDED = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=5, max_tokens=10, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_num_seqs=4, max_model_len=128, return_sampling_mask=True,
              logprobs_mode="processed_logprobs")


def _outputs(llm: LLM) -> list[tuple[list[int], list[list[int]] | None]]:
    greedy = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    seeded = llm.generate(PROMPTS, SEEDED, use_tqdm=False)
    return ([(list(o.outputs[0].token_ids), None) for o in greedy]
            + [(list(o.outputs[0].token_ids), [list(m) for m in o.outputs[0].sampling_mask.token_ids])
               for o in seeded])


@pytest.fixture(scope="module")
def ray_llm() -> Iterator[LLM]:
    # NOTE: Ray's worker processes inherit the environment, not this process's sys.path: the callables sent by
    # reference (rl_worker_ext) must be importable there too.
    here = os.path.dirname(os.path.abspath(__file__))
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, previous) if p)
    try:
        llm = LLM(**ENGINE, tensor_parallel_size=2, distributed_executor_backend="ray")
    finally:
        if previous is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = previous
    yield llm
    llm.llm_engine.shutdown()


def test_ray_tp2_outputs_equal_tp1(ray_llm: LLM) -> None:
    # The TP=1 reference asks for the ray backend too: vLLM accepts it at one rank, where the worker runs in the
    # engine core's process (UniProcExecutor) and no Ray resource is taken.
    reference = LLM(**ENGINE, distributed_executor_backend="ray")
    try:
        assert type(reference.llm_engine.engine_core.engine_core.model_executor).__name__ == "UniProcExecutor"
        want = _outputs(reference)
    finally:
        reference.llm_engine.shutdown()
    assert _outputs(ray_llm) == want


def test_ray_collective_rpc(ray_llm: LLM) -> None:
    assert ray_llm.collective_rpc(rank_and_double, args=(3,)) == [(0, 6), (1, 6)]
    infos = ray_llm.collective_rpc("weight_info")
    assert len(infos) == 2 and infos[0].keys() == infos[1].keys()


def test_killed_ray_worker_gives_engine_dead_error(ray_llm: LLM) -> None:
    """Last in the module: rank 1's actor process dies; generate fails with EngineDeadError instead of hanging."""
    pids = ray_llm.collective_rpc(worker_pid)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    os.kill(pids[1], signal.SIGKILL)
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            ray_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        except BaseException as e:  # noqa: BLE001
            box[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(90)
    assert not thread.is_alive(), "generate hung after a Ray worker died"
    assert isinstance(box[0], EngineDeadError), box[0]
