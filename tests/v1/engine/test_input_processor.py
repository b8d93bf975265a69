"""InputProcessor: tokenization, request validation errors, max_tokens resolution, EOS / stop ids."""

from __future__ import annotations

import json
import os

import pytest
from test_tokenizer import build_tokenizer_folder

from vllm.config import ModelConfig, VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TextPrompt, TokensPrompt
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.v1.engine.input_processor import InputProcessor, check_max_tokens

MAX_MODEL_LEN = 32
CONFIG_EOS = 1  # deliberately different from the tokenizer's EOS, to see which one is used


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = build_tokenizer_folder(str(tmp_path_factory.mktemp("model")))
    vocab_size = get_tokenizer(folder).vocab_size
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen2ForCausalLM"], "vocab_size": vocab_size,
                   "max_position_embeddings": MAX_MODEL_LEN, "eos_token_id": CONFIG_EOS}, f)
    return folder


@pytest.fixture(scope="module")
def tok(model_dir: str) -> Tokenizer:
    return get_tokenizer(model_dir)


def make_processor(model_dir: str, tok: Tokenizer | None, masks: bool = False, **model_kwargs) -> InputProcessor:
    mode = "processed_logprobs" if masks else "raw_logprobs"
    config = VllmConfig(model_config=ModelConfig(model=model_dir, return_sampling_mask=masks, logprobs_mode=mode,
                                                 max_logprobs=5, **model_kwargs))
    return InputProcessor(config, tok)


def test_text_and_token_prompts(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    text = "héllo wörld 日本"
    for prompt in (text, {"prompt": text}):
        req, prompt_text = proc.process_inputs("r", prompt, SamplingParams(max_tokens=4), arrival_time=1.5)
        assert req.prompt_token_ids == tok.encode(text)
        assert prompt_text == text
        assert req.arrival_time == 1.5 and req.request_id == "r"
    req, prompt_text = proc.process_inputs("r", {"prompt_token_ids": [3, 4, 5]}, SamplingParams())
    assert req.prompt_token_ids == [3, 4, 5] and prompt_text is None


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [0, 10**6]}, "out of vocabulary range"),
    ({"prompt_token_ids": [-1]}, "out of vocabulary range"),
    ({"prompt_token_ids": ["a"]}, "list of integers"),
    ({"text": "x"}, "'prompt'"),
    (42, "A prompt must be"),
])
def test_prompt_errors(model_dir: str, tok: Tokenizer, prompt, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_processor(model_dir, tok).process_inputs("r", prompt, SamplingParams())


def test_prompt_too_long(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    with pytest.raises(ValueError, match=rf"The prompt \({MAX_MODEL_LEN} tokens\) is longer than the maximum "
                                         rf"model length of {MAX_MODEL_LEN}"):
        proc.process_inputs("r", {"prompt_token_ids": [3] * MAX_MODEL_LEN}, SamplingParams())
    # One token shorter leaves room for exactly one output token.
    req, _ = proc.process_inputs("r", {"prompt_token_ids": [3] * (MAX_MODEL_LEN - 1)}, SamplingParams())
    assert req.sampling_params.max_tokens == 1


def test_skip_tokenizer_init(model_dir: str) -> None:
    proc = make_processor(model_dir, None, skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        proc.process_inputs("r", "hello", SamplingParams())
    with pytest.raises(ValueError, match="Stop strings need"):
        proc.process_inputs("r", {"prompt_token_ids": [3]}, SamplingParams(stop=["x"]))
    req, _ = proc.process_inputs("r", {"prompt_token_ids": [3]}, SamplingParams())
    # Without a tokenizer the EOS comes from config.json; generation_config.json's ids become stop ids.
    assert req.eos_token_id == CONFIG_EOS
    generation_eos = set(json.load(open(os.path.join(model_dir, "generation_config.json")))["eos_token_id"])
    assert set(req.sampling_params.stop_token_ids) == generation_eos - {CONFIG_EOS}


def test_max_tokens_resolution_and_no_mutation(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    prompt = {"prompt_token_ids": [3] * 10}
    for max_tokens, expected in ((None, MAX_MODEL_LEN - 10), (1000, MAX_MODEL_LEN - 10), (3, 3)):
        params = SamplingParams(max_tokens=max_tokens)
        req, _ = proc.process_inputs("r", prompt, params)
        assert req.sampling_params.max_tokens == expected
        assert params.max_tokens == max_tokens
        assert req.sampling_params is not params


def test_logprobs_limit(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    proc.process_inputs("r", "hi", SamplingParams(logprobs=5))
    with pytest.raises(ValueError, match="maximum of 5"):
        proc.process_inputs("r", "hi", SamplingParams(logprobs=6))


def test_eos_and_stop_ids(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    eos = tok.convert_tokens_to_ids(["<|im_end|>"])[0]
    endoftext = tok.convert_tokens_to_ids(["<|endoftext|>"])[0]
    params = SamplingParams(stop_token_ids=[9])
    req, _ = proc.process_inputs("r", "hi", params)
    assert req.eos_token_id == eos
    assert req.sampling_params.stop_token_ids == [9, endoftext]
    assert req.sampling_params.all_stop_token_ids == {9, endoftext}
    assert params.stop_token_ids == [9] and params.all_stop_token_ids == {9}
    req, _ = proc.process_inputs("r", "hi", SamplingParams(ignore_eos=True))
    assert req.sampling_params.stop_token_ids == [] and req.sampling_params.all_stop_token_ids == set()


def test_sampling_mask_validation(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok, masks=True)
    req, _ = proc.process_inputs("r", "hi", SamplingParams(temperature=1.0, top_k=5))
    assert req.sampling_params.return_sampling_mask is True
    for params in (SamplingParams(temperature=0.0, top_k=5), SamplingParams(temperature=1.0),
                   SamplingParams(temperature=0.7, top_k=0, return_sampling_mask=True)):
        with pytest.raises(ValueError, match="temperature > 0 and top_k > 0"):
            proc.process_inputs("r", "hi", params)
    # A request that opts out is not constrained and gets no masks.
    req, _ = proc.process_inputs("r", "hi", SamplingParams(temperature=0.0, return_sampling_mask=False))
    assert req.sampling_params.return_sampling_mask is False

    off = make_processor(model_dir, tok, masks=False)
    with pytest.raises(ValueError, match="--return-sampling-mask"):
        off.process_inputs("r", "hi", SamplingParams(temperature=1.0, top_k=5, return_sampling_mask=True))
    req, _ = off.process_inputs("r", "hi", SamplingParams(temperature=0.0))
    assert req.sampling_params.return_sampling_mask is False


def test_typed_prompts_are_the_plain_dicts(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok)
    params = SamplingParams(max_tokens=4)
    plain, _ = proc.process_inputs("r", {"prompt_token_ids": [3, 4, 5]}, params)
    typed, text = proc.process_inputs("r", TokensPrompt(prompt_token_ids=[3, 4, 5]), params)
    assert typed.prompt_token_ids == plain.prompt_token_ids == [3, 4, 5] and text is None
    # The text of a tokens prompt is carried along, never tokenized.
    typed, text = proc.process_inputs("r", TokensPrompt(prompt_token_ids=[3, 4, 5], prompt="abc"), params)
    assert typed.prompt_token_ids == [3, 4, 5] and text == "abc"
    typed, text = proc.process_inputs("r", TextPrompt(prompt="hi there"), params)
    assert typed.prompt_token_ids == tok.encode("hi there") and text == "hi there"


def test_cache_salt_is_carried_and_checked(model_dir: str, tok: Tokenizer) -> None:
    """vLLM's rule: None or a non-empty string; it reaches the engine core with the request (n > 1 children are
    copies of it)."""
    proc = make_processor(model_dir, tok)
    req, _ = proc.process_inputs("r", TokensPrompt(prompt_token_ids=[3, 4], cache_salt="policy-3"), SamplingParams())
    assert req.cache_salt == "policy-3"
    req, _ = proc.process_inputs("r", TextPrompt(prompt="hi", cache_salt="s"), SamplingParams())
    assert req.cache_salt == "s"
    assert proc.process_inputs("r", {"prompt_token_ids": [3]}, SamplingParams())[0].cache_salt is None
    for bad in ("", 5, ["s"], "\ud800"):
        with pytest.raises(VLLMValidationError, match="cache_salt") as e:
            proc.process_inputs("r", {"prompt_token_ids": [3], "cache_salt": bad}, SamplingParams())
        assert e.value.parameter == "cache_salt"


@pytest.mark.parametrize("key", ["multi_modal_data", "mm_processor_kwargs", "prompt_embeds"])
def test_prompt_keys_not_honoured_are_refused(model_dir: str, tok: Tokenizer, key: str) -> None:
    prompt = {"prompt_token_ids": [3, 4, 5], key: {"image": None}}
    with pytest.raises(ValueError, match=rf"Unsupported prompt key\(s\): '{key}'\. This engine takes only 'prompt' "
                                         r"\(text\) and 'prompt_token_ids'"):
        make_processor(model_dir, tok).process_inputs("r", prompt, SamplingParams())


@pytest.mark.parametrize("empty", [None, {}, [], ()])
def test_prompt_keys_that_ask_for_nothing_are_ignored(model_dir: str, tok: Tokenizer, empty: object) -> None:
    """vLLM's optional keys given as None or empty ask for nothing: the prompt is the plain tokens prompt (verl sends
    TokensPrompt(prompt_token_ids=..., multi_modal_data={}) with every text request)."""
    proc = make_processor(model_dir, tok)
    for prompt in ({"prompt_token_ids": [3, 4, 5], "multi_modal_data": empty, "cache_salt": None},
                   TokensPrompt(prompt_token_ids=[3, 4, 5], multi_modal_data=empty)):  # type: ignore[typeddict-item]
        req, text = proc.process_inputs("r", prompt, SamplingParams())
        assert req.prompt_token_ids == [3, 4, 5] and text is None
    # A non-empty one is refused, named (the other keys ask for nothing).
    prompt = {"prompt_token_ids": [3], "multi_modal_data": empty, "mm_processor_kwargs": {"x": 1}}
    with pytest.raises(VLLMValidationError, match=r"Unsupported prompt key\(s\): 'mm_processor_kwargs'\.") as e:
        proc.process_inputs("r", prompt, SamplingParams())
    assert e.value.parameter == "mm_processor_kwargs"


@pytest.mark.parametrize("text, index", [("\ud800", 0), ("abc \udfff def", 4), ("日本\udbff", 2)])
def test_lone_surrogate_in_text_prompt_is_a_validation_error(model_dir: str, tok: Tokenizer, text: str,
                                                             index: int) -> None:
    """The tokenizer cannot take a lone surrogate (it raised TypeError, an HTTP 500): a named ValueError instead."""
    with pytest.raises(VLLMValidationError, match="prompt is not valid Unicode: a lone surrogate") as e:
        make_processor(model_dir, tok).process_inputs("r", text, SamplingParams())
    assert e.value.parameter == "prompt"
    assert e.value.args[0].endswith(f"at character {index}.")


@pytest.mark.parametrize("prompt, parameter", [
    ({"prompt_token_ids": [2**64]}, "prompt_token_ids"),
    ({"prompt_token_ids": [-(2**70)]}, "prompt_token_ids"),
    ({"prompt_token_ids": [True, False]}, "prompt_token_ids"),
    ({"prompt_token_ids": [3] * MAX_MODEL_LEN}, "prompt"),
])
def test_prompt_errors_name_the_field(model_dir: str, tok: Tokenizer, prompt: object, parameter: str) -> None:
    with pytest.raises(VLLMValidationError) as e:
        make_processor(model_dir, tok).process_inputs("r", prompt, SamplingParams())
    assert e.value.parameter == parameter


def test_check_max_tokens_is_vllms_rule_and_message() -> None:
    """The server's rule (hand-worked): max_model_len 32, a 10-token prompt leaves 22."""
    check_max_tokens(22, 10, 32)
    check_max_tokens(None, 10, 32)
    check_max_tokens(1000, 32, 32)  # no room at all: the input processor's own error, not this one
    with pytest.raises(VLLMValidationError) as e:
        check_max_tokens(23, 10, 32)
    assert e.value.parameter == "max_tokens" and e.value.value == 23
    assert e.value.args[0] == ("'max_tokens' or 'max_completion_tokens' is too large: 23. This model's maximum "
                               "context length is 32 tokens and your request has 10 input tokens (23 > 32 - 10).")
    with pytest.raises(VLLMValidationError) as e:
        check_max_tokens(2**64, 1, 32, "sampling_params.max_tokens")
    assert e.value.parameter == "sampling_params.max_tokens"


def test_validation_errors_name_the_field(model_dir: str, tok: Tokenizer) -> None:
    proc = make_processor(model_dir, tok, masks=True)
    cases = [(SamplingParams(temperature=0.0), "temperature"), (SamplingParams(temperature=1.0), "top_k"),
             (SamplingParams(temperature=1.0, top_k=5, logprobs=6), "logprobs")]
    for params, parameter in cases:
        with pytest.raises(VLLMValidationError) as e:
            proc.process_inputs("r", "hi", params)
        assert e.value.parameter == parameter
