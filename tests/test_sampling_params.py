"""SamplingParams validation against hand-worked cases: each bad value is a VLLMValidationError (a ValueError) that
names the field; the boundary values are accepted; vLLM's unimplemented fields are named ValueErrors, not
TypeErrors; every accepted value encodes on the engine's msgspec wire."""

from __future__ import annotations

import math

import msgspec
import pytest

from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def test_vllm_validation_error_is_vllms() -> None:
    e = VLLMValidationError("top_p must be in (0, 1], got 1.5.", parameter="top_p", value=1.5)
    assert isinstance(e, ValueError)
    assert (e.parameter, e.value) == ("top_p", 1.5)
    assert str(e) == "top_p must be in (0, 1], got 1.5. (parameter=top_p, value=1.5)"
    assert str(VLLMValidationError("plain")) == "plain"
    # A client-sized value is cut in the message.
    assert len(str(VLLMValidationError("x", parameter="stop", value=["a" * 10_000]))) < 200


@pytest.mark.parametrize("kwargs, parameter", [
    # Non-finite and absurd floats (temperature: [0, 2] as OpenAI and vLLM).
    ({"temperature": math.inf}, "temperature"),
    ({"temperature": -math.inf}, "temperature"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": 1e39}, "temperature"),
    ({"temperature": 2**64}, "temperature"),
    ({"temperature": 2.0001}, "temperature"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": math.nan}, "top_p"),
    ({"top_p": math.inf}, "top_p"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.0000001}, "top_p"),
    ({"min_p": math.nan}, "min_p"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": math.nan}, "presence_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -math.inf}, "frequency_penalty"),
    ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    # Integers: ints (not bools), within int64.
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 5.0}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 16385}, "n"),
    ({"n": 10**30}, "n"),
    ({"n": 2.0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 2**64, "max_tokens": None}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 2**64}, "logprobs"),
    ({"seed": 2**63}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"seed": INT64_MIN - 1}, "seed"),
    ({"seed": "1"}, "seed"),
    ({"seed": INT64_MAX, "n": 2}, "seed"),  # sample 1 would be seeded with 2**63
    ({"seed": INT64_MAX - 2, "n": 4}, "seed"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    # Strings.
    ({"stop": ""}, "stop"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", None]}, "stop"),
    ({"stop": "\ud800"}, "stop"),
    ({"stop": ["fine", "a\udfffb"]}, "stop"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"return_sampling_mask": 1}, "return_sampling_mask"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
])
def test_bad_values_are_named_validation_errors(kwargs: dict, parameter: str) -> None:
    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(**kwargs)
    assert isinstance(e.value, ValueError)
    assert e.value.parameter == parameter, str(e.value)
    assert parameter in str(e.value)


@pytest.mark.parametrize("kwargs", [
    {"temperature": 0.0}, {"temperature": 2.0}, {"temperature": 2}, {"top_p": 1e-9}, {"top_p": 1},
    {"min_p": 0}, {"min_p": 1.0}, {"top_k": -1}, {"top_k": 0}, {"top_k": INT64_MAX}, {"n": 16384},
    {"max_tokens": INT64_MAX}, {"max_tokens": None, "min_tokens": INT64_MAX}, {"logprobs": 0},
    {"seed": INT64_MIN}, {"seed": INT64_MAX}, {"seed": INT64_MAX - 3, "n": 4}, {"seed": -1},
    {"stop_token_ids": [0, INT64_MAX]}, {"stop_token_ids": (1, 2)}, {"stop": "日本"}, {"stop": ["a", "b"]},
    {"best_of": 1}, {"best_of": 3, "n": 3}, {"logits_processors": []}, {"bad_words": []}, {"logit_bias": {}},
    {"presence_penalty": 0, "frequency_penalty": 0.0, "repetition_penalty": 1},
    {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2}, {"logit_bias": {0: -100}},
    {"allowed_token_ids": [0]}, {"bad_words": ["x"]},
])
def test_boundary_values_are_accepted_and_encode(kwargs: dict) -> None:
    params = SamplingParams(**kwargs)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.n == params.n and decoded.seed == params.seed and decoded.max_tokens == params.max_tokens


def test_vllm_spellings_are_normalised() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(logprobs=True).logprobs == 1  # vLLM's spelling of 1
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(stop="x").stop == ["x"]


def test_max_n_sequences_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    SamplingParams(n=4)
    with pytest.raises(VLLMValidationError, match=r"n must be an integer in \[1, 4\] \(VLLM_MAX_N_SEQUENCES\)"):
        SamplingParams(n=5)


@pytest.mark.parametrize("field, value", [
    ("best_of", 2), ("logits_processors", [lambda ids, logits: logits]), ("structured_outputs", {"json": {}}),
])
def test_unimplemented_vllm_fields_are_named_value_errors(field: str, value: object) -> None:
    """vLLM's names: a ValueError that names the field (it was a TypeError, or dropped), never a silent no-op,
    since the sampling mask must describe the distribution the token was drawn from."""
    with pytest.raises(ValueError, match=rf"^{field}(=\S+)? is not supported") as e:
        SamplingParams(**{field: value})
    assert isinstance(e.value, VLLMValidationError) and e.value.parameter == field


def test_token_fields_are_accepted_normalised_and_encode() -> None:
    params = SamplingParams(logit_bias={"5": 250, 7: -3.5, "+8": -1e9}, allowed_token_ids=(1, 2, 3),
                            bad_words=["spam eggs"], presence_penalty=0.5, frequency_penalty=-2,
                            repetition_penalty=1.1, min_tokens=3)
    # OpenAI's string keys become ids; values are clamped to vLLM's [-100, 100].
    assert params.logit_bias == {5: 100.0, 7: -3.5, 8: -100.0}
    assert params.allowed_token_ids == [1, 2, 3]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded.logit_bias == params.logit_bias and decoded.bad_words == ["spam eggs"]
    assert decoded.presence_penalty == 0.5 and decoded.repetition_penalty == 1.1


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {5: float("nan")}}, "logit_bias"), ({"logit_bias": {5: float("inf")}}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": {1: True}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"bad_words": "spam"}, "bad_words"),
    ({"bad_words": [1]}, "bad_words"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_token_fields_bad_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(VLLMValidationError) as e:
        SamplingParams(**kwargs)
    assert e.value.parameter == field


def test_clone_and_wire_keep_the_checks() -> None:
    params = SamplingParams(temperature=0.5, top_k=3, seed=7, n=2, stop=["x"])
    assert params.clone() == params
    with pytest.raises(msgspec.ValidationError, match="temperature must be a finite number"):
        msgspec.convert({"temperature": math.inf}, SamplingParams)
    # Not passed to the engine: the None defaults of the unimplemented fields are not on the wire.
    assert b"best_of" not in msgspec.msgpack.encode(params)
    assert "best_of" not in repr(params) and "best_of=3" in repr(SamplingParams(best_of=3, n=3))
