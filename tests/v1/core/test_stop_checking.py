"""Stop conditions through the scheduler: EOS, stop_token_ids, min_tokens, max_tokens, ignore_eos, max_model_len.

Each case scripts the tokens the fake runner samples and states, by hand, where the output must end and why.
"""

from collections.abc import Callable
from typing import Any

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.core.sched.utils import append_sampled, check_stop
from vllm.v1.engine import FinishReason
from vllm.v1.request import Request, RequestStatus

EOS = 2
PROMPT_LEN = 5


def run_scripted(make_scheduler: Callable[..., Scheduler], fake_runner: Any, request_factory: Callable[..., Request],
                 script: list[int], max_model_len: int = 64, eos_token_id: int | None = EOS,
                 **params: Any) -> tuple[Request, list[int], list[Any]]:
    sched = make_scheduler(max_model_len=max_model_len)
    req = request_factory("r", PROMPT_LEN, eos_token_id=eos_token_id, **params)
    sched.add_request(req)
    runner = fake_runner(sched, next_token=lambda rid, toks: script[len(toks) - PROMPT_LEN])
    tokens: list[int] = []
    outputs = []
    while sched.has_requests():
        _, outs = runner.step()
        outputs += outs.outputs
        for o in outs.outputs:
            tokens += o.new_token_ids
    assert sched.kv_cache_manager.get_num_free_blocks() == sched.kv_cache_manager.num_blocks
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return req, tokens, outputs


# (script, sampling params, expected tokens, finish reason, stop reason)
CASES = [
    ([5, 6, EOS, 7], {}, [5, 6, EOS], FinishReason.STOP, None),
    ([5, EOS, 6, 7], {"ignore_eos": True, "max_tokens": 3}, [5, EOS, 6], FinishReason.LENGTH, None),
    ([5, 6, 7, 8], {"stop_token_ids": [7, 9]}, [5, 6, 7], FinishReason.STOP, 7),
    ([EOS, 6, 7, 8, EOS, 3], {"stop_token_ids": [6], "min_tokens": 3}, [EOS, 6, 7, 8, EOS], FinishReason.STOP,
     None),
    ([6, 4, 6, 4], {"stop_token_ids": [6], "min_tokens": 2}, [6, 4, 6], FinishReason.STOP, 6),
    ([5, 6, 7, 8], {"max_tokens": 2}, [5, 6], FinishReason.LENGTH, None),
    ([5, EOS, 7], {"max_tokens": 2}, [5, EOS], FinishReason.STOP, None),  # stop wins on the last allowed token
    # A stop token that is exactly the min_tokens-th output stops; one before it does not.
    ([5, 6, 7, 8], {"stop_token_ids": [7], "min_tokens": 3}, [5, 6, 7], FinishReason.STOP, 7),
    ([7, 5, 7, 8], {"stop_token_ids": [7], "min_tokens": 3}, [7, 5, 7], FinishReason.STOP, 7),
    ([5, EOS, 6, EOS], {"min_tokens": 3}, [5, EOS, 6, EOS], FinishReason.STOP, None),
    # EOS that is also a stop token reports EOS (no stop reason), unless ignore_eos makes it a plain stop token.
    ([5, EOS, 6], {"stop_token_ids": [EOS]}, [5, EOS], FinishReason.STOP, None),
    ([5, EOS, 6], {"stop_token_ids": [EOS], "ignore_eos": True}, [5, EOS], FinishReason.STOP, EOS),
    # A stop token that is also the last allowed (min_tokens == max_tokens) reports STOP.
    ([5, 6, 7, 8], {"stop_token_ids": [7], "min_tokens": 3, "max_tokens": 3}, [5, 6, 7], FinishReason.STOP, 7),
    ([5, 6, 8, 7], {"stop_token_ids": [7], "min_tokens": 3, "max_tokens": 3}, [5, 6, 8], FinishReason.LENGTH,
     None),
]


@pytest.mark.parametrize("script,params,expected,finish_reason,stop_reason", CASES)
def test_stop_conditions(make_scheduler: Callable[..., Scheduler], fake_runner: Any,
                         request_factory: Callable[..., Request], script: list[int], params: dict[str, Any],
                         expected: list[int], finish_reason: FinishReason, stop_reason: int | None) -> None:
    req, tokens, outputs = run_scripted(make_scheduler, fake_runner, request_factory, script, **params)
    assert tokens == expected == req.output_token_ids
    assert outputs[-1].finish_reason == finish_reason
    assert outputs[-1].stop_reason == stop_reason


def test_no_eos_token_id_never_stops_on_eos(make_scheduler: Callable[..., Scheduler], fake_runner: Any,
                                            request_factory: Callable[..., Request]) -> None:
    _, tokens, outputs = run_scripted(make_scheduler, fake_runner, request_factory, [EOS, EOS, EOS],
                                      eos_token_id=None, max_tokens=3)
    assert tokens == [EOS, EOS, EOS] and outputs[-1].finish_reason == FinishReason.LENGTH


def test_max_model_len_caps_output(make_scheduler: Callable[..., Scheduler], fake_runner: Any,
                                   request_factory: Callable[..., Request]) -> None:
    # 5 prompt tokens + 3 outputs = max_model_len 8, although max_tokens and min_tokens ask for more.
    req, tokens, outputs = run_scripted(make_scheduler, fake_runner, request_factory, [5, 6, 7, 8, 9],
                                        max_model_len=8, max_tokens=5, min_tokens=4)
    assert tokens == [5, 6, 7] and req.num_tokens == 8
    assert outputs[-1].finish_reason == FinishReason.LENGTH


def test_check_stop_length_and_stop_token() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=2, stop_token_ids=[9]), eos_token_id=EOS)
    req.append_output_token_ids(4)
    assert not check_stop(req, max_model_len=100) and req.status == RequestStatus.WAITING
    req.append_output_token_ids(9)
    assert check_stop(req, max_model_len=100)
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 9
    req = Request("s", [1, 2, 3], SamplingParams(max_tokens=10), eos_token_id=EOS)
    req.append_output_token_ids(4)
    assert check_stop(req, max_model_len=4) and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_append_sampled_without_stop_appends_a_copy() -> None:
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, stop_token_ids=[9]), eos_token_id=EOS)
    sampled = [4, 5, 6]
    new, finished = append_sampled(req, sampled, max_model_len=100)
    assert new == [4, 5, 6] and new is not sampled and not finished
    assert req.output_token_ids == [4, 5, 6] and req.all_token_ids == [1, 2, 3, 4, 5, 6]
    assert req.status == RequestStatus.WAITING and req.stop_reason is None


@pytest.mark.parametrize("sampled,params,max_model_len,kept,status,stop_reason", [
    # Several tokens in one step (as with speculative decoding): everything after the finishing token is dropped.
    ([4, 9, 5], {"stop_token_ids": [9]}, 100, [4, 9], RequestStatus.FINISHED_STOPPED, 9),
    ([4, EOS, 9], {"stop_token_ids": [9]}, 100, [4, EOS], RequestStatus.FINISHED_STOPPED, None),
    ([4, EOS, 9], {"stop_token_ids": [9], "ignore_eos": True}, 100, [4, EOS, 9], RequestStatus.FINISHED_STOPPED, 9),
    # min_tokens=2: the first 9 (output 1) is kept, the second (output 3) stops.
    ([9, 4, 9, 5], {"stop_token_ids": [9], "min_tokens": 2}, 100, [9, 4, 9], RequestStatus.FINISHED_STOPPED, 9),
    ([4, 5, 6, 7], {"max_tokens": 2}, 100, [4, 5], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    # 3 prompt tokens + 2 outputs reach max_model_len 5.
    ([4, 5, 6, 7], {}, 5, [4, 5], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    ([4, 5], {"max_tokens": 2}, 100, [4, 5], RequestStatus.FINISHED_LENGTH_CAPPED, None),
    ([4, 5], {"stop_token_ids": [9]}, 100, [4, 5], RequestStatus.WAITING, None),
])
def test_append_sampled_cuts_at_the_finishing_token(sampled: list[int], params: dict[str, Any], max_model_len: int,
                                                    kept: list[int], status: RequestStatus,
                                                    stop_reason: int | None) -> None:
    params.setdefault("max_tokens", 10)
    req = Request("r", [1, 2, 3], SamplingParams(**params), eos_token_id=EOS)
    new, finished = append_sampled(req, sampled, max_model_len)
    assert new == kept == req.output_token_ids and req.all_token_ids == [1, 2, 3] + kept
    assert finished == (status != RequestStatus.WAITING)
    assert req.status == status and req.stop_reason == stop_reason


def test_append_sampled_counts_earlier_outputs() -> None:
    # min_tokens and max_tokens count all outputs, not just this step's.
    req = Request("r", [1], SamplingParams(max_tokens=5, min_tokens=3, stop_token_ids=[9]), eos_token_id=EOS)
    assert append_sampled(req, [9, 4], max_model_len=100) == ([9, 4], False)
    assert append_sampled(req, [9, 9], max_model_len=100) == ([9], True)
    assert req.output_token_ids == [9, 4, 9] and req.stop_reason == 9
    req = Request("s", [1], SamplingParams(max_tokens=5), eos_token_id=EOS)
    assert append_sampled(req, [4, 5, 6], max_model_len=100) == ([4, 5, 6], False)
    assert append_sampled(req, [7, 8, 9], max_model_len=100) == ([7, 8], True)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
