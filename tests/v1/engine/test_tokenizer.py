"""vllm.transformers_utils.tokenizer against transformers' tokenizer loaded from the same folder.

`build_tokenizer_folder` (also used by the detokenizer / output / input processor tests) trains a tiny byte-level
BPE with `tokenizers` on a few sentences with non-ASCII text, adds ChatML special tokens and writes a
tokenizer_config.json with a ChatML chat template and a generation_config.json with two EOS ids.
"""

from __future__ import annotations

import json
import os
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer

SENTENCES = [
    "Hello world, this is a tiny tokenizer for tests.",
    "héllo wörld 日本 日本語のテキスト",
    "The quick brown fox jumps over the lazy dog. STOP here!",
    "Ünïcödé ✓ emoji 🙂 text; naïve café.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer_folder(folder: str, add_bos_token: bool = False, bos_post_processor: bool = False,
                           chat_template: str | None = CHATML_TEMPLATE) -> str:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 4, trainer)
    if bos_post_processor:
        bos_id = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                           special_tokens=[("<s>", bos_id)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config: dict = {
        "bos_token": {"__type": "AddedToken", "content": "<s>", "special": True, "lstrip": False,
                      "rstrip": False, "normalized": False, "single_word": False},
        "eos_token": "<|im_end|>",
        "add_bos_token": add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}, f)
    return folder


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tokenizer_folder(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def hf(tok_dir: str):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(tok_dir)


# The last one is longer than _GIL_FREE_CHARS (encoded through encode_batch, with the GIL released).
TEXTS = SENTENCES + ["", "  leading spaces", "mixed <|im_start|>special<|im_end|> tokens", "日本\nwörld\t🙂",
                     " ".join(SENTENCES) * 200 + " <|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_matches_transformers(tok_dir: str, hf, text: str) -> None:
    tok = get_tokenizer(tok_dir)
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_and_vocab(tok_dir: str, hf) -> None:
    tok = get_tokenizer(tok_dir)
    assert tok.eos_token_id == hf.eos_token_id == hf.convert_tokens_to_ids("<|im_end|>")
    assert tok.bos_token_id == hf.bos_token_id
    assert tok.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= set(tok.all_special_ids)
    assert set(tok.all_special_ids) == {hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert tok.get_eos_token_ids() == {hf.convert_tokens_to_ids("<|im_end|>"),
                                       hf.convert_tokens_to_ids("<|endoftext|>")}
    ids = tok.encode("héllo wörld 日本")
    assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert tok.model_max_length == 128


def test_random_id_decode_matches_transformers(tok_dir: str, hf) -> None:
    tok = get_tokenizer(tok_dir)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 12))]
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok_dir: str, hf, add_generation_prompt: bool) -> None:
    tok = get_tokenizer(tok_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 日本?"},
                {"role": "assistant", "content": "wörld"}, {"role": "user", "content": "again"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ref = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    ref_ids = ref["input_ids"] if not isinstance(ref, list) else ref
    assert ids == ref_ids


def test_chat_template_errors(tmp_path, tok_dir: str) -> None:
    tok = get_tokenizer(tok_dir)
    with pytest.raises(ValueError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    no_template = get_tokenizer(build_tokenizer_folder(str(tmp_path / "nt"), chat_template=None))
    with pytest.raises(ValueError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])


def test_chat_template_variables_and_sandbox(tok_dir: str) -> None:
    tok = get_tokenizer(tok_dir)
    out = tok.apply_chat_template([], chat_template="{{ bos_token }}|{{ eos_token }}|{{ tools | tojson }}",
                                  tools=[{"name": "a<b"}])
    assert out == '<s>|<|im_end|>|[{"name": "a<b"}]'
    with pytest.raises(ValueError, match="unsafe"):
        tok.apply_chat_template([], chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")


def test_add_bos_token(tmp_path) -> None:
    plain = get_tokenizer(build_tokenizer_folder(str(tmp_path / "a")))
    with_bos = get_tokenizer(build_tokenizer_folder(str(tmp_path / "b"), add_bos_token=True))
    text = "héllo wörld"
    bos = with_bos.bos_token_id
    assert bos is not None
    assert with_bos.encode(text) == [bos] + plain.encode(text)
    assert with_bos.encode(text, add_special_tokens=False) == plain.encode(text)


def test_bos_from_post_processor_not_doubled(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    folder = build_tokenizer_folder(str(tmp_path / "c"), add_bos_token=True, bos_post_processor=True)
    tok = get_tokenizer(folder)
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    for text in SENTENCES:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text)[:2].count(tok.bos_token_id) == 1


def test_missing_tokenizer_json(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(str(tmp_path))
    with pytest.raises(ValueError, match="not a local folder"):
        get_tokenizer(str(tmp_path / "missing"))
