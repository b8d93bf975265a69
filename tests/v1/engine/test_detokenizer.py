"""Incremental detokenizer: piecewise text equals a full decode; stop strings and the streaming hold-back."""

from __future__ import annotations

import random

import pytest
from test_tokenizer import build_tokenizer_folder

from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer, get_tokenizer
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.engine.detokenizer import IncrementalDetokenizer, check_stop_strings


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return get_tokenizer(build_tokenizer_folder(str(tmp_path_factory.mktemp("tok"))))


def make_detok(tok: Tokenizer | None, prompt_ids: list[int], **params) -> IncrementalDetokenizer:
    request = EngineCoreRequest(request_id="r", prompt_token_ids=prompt_ids,
                                sampling_params=SamplingParams(**params), eos_token_id=None)
    return IncrementalDetokenizer.from_new_request(tok, request)


def feed_in_chunks(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random,
                   finish: bool = True) -> list[str]:
    """Feed ids in random chunk sizes; returns the streamed deltas."""
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 3)
        chunk = ids[i:i + n]
        i += n
        last = i >= len(ids)
        assert detok.update(chunk, stop_terminated=False, finished=finish and last) is None
        deltas.append(detok.get_next_output_text(finished=finish and last, delta=True))
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_incremental_equals_full_decode_random_ids(tok: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(1234 + skip_special_tokens)
    for _ in range(60):
        prompt = tok.encode(rng.choice(["héllo wörld 日本", "The quick", "🙂 x"]))
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        detok = make_detok(tok, prompt, skip_special_tokens=skip_special_tokens)
        expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        streamed = ""
        for delta in feed_in_chunks(detok, ids, rng):
            streamed += delta
            # Never half a character, never a revision: what is streamed is a prefix of the full decode.
            assert expected.startswith(streamed)
        assert detok.output_text == expected
        assert streamed == expected
        assert detok.output_token_ids == ids


def test_multibyte_characters_split_across_byte_tokens(tok: Tokenizer) -> None:
    """Every UTF-8 byte as its own token: no partial character is ever emitted."""
    text = "héllo wörld 日本 🙂"
    vocab = tok.get_vocab()
    byte_ids = [vocab[_byte_level_char(b)] for b in text.encode("utf-8")]
    assert tok.decode(byte_ids) == text
    detok = make_detok(tok, tok.encode("prompt"))
    emitted: list[str] = []
    for i, t in enumerate(byte_ids):
        detok.update([t], stop_terminated=False, finished=i == len(byte_ids) - 1)
        emitted.append(detok.get_next_output_text(finished=False, delta=True))
        assert "\ufffd" not in detok.output_text
    assert "".join(emitted) == text
    # The three bytes of 日 produce text only on the third.
    start = len("héllo wörld ".encode("utf-8"))
    assert emitted[start:start + 3] == ["", "", "日"]


def _byte_level_char(b: int) -> str:
    """GPT-2's byte -> printable character map (the byte-level pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    if b in printable:
        return chr(b)
    return chr(256 + sorted(set(range(256)) - set(printable)).index(b))


def _reference_stop(tok: Tokenizer, ids: list[int], stop: str, include: bool) -> tuple[int, str]:
    """Brute force: the first k whose full decode contains `stop`, and the text cut there."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        if stop in text:
            index = text.index(stop)
            return k, text[:index + len(stop)] if include else text[:index]
    raise AssertionError("stop string not in text")


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop", ["fox jum", "y dog. ST", "ő", "over"])
def test_stop_string_across_tokens(tok: Tokenizer, stop: str, include: bool) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. STOP here! ő trailing")
    detok = make_detok(tok, tok.encode("Hi"), stop=[stop], include_stop_str_in_output=include)
    k_ref, text_ref = _reference_stop(tok, ids, stop, include)
    hit = None
    streamed = ""
    for i, t in enumerate(ids):
        hit = detok.update([t], stop_terminated=False)
        streamed += detok.get_next_output_text(finished=hit is not None, delta=True)
        assert text_ref.startswith(streamed)
        if hit is not None:
            break
    assert hit == stop
    assert detok.num_output_tokens == k_ref
    assert detok.output_text == text_ref
    assert streamed == text_ref


def test_stop_string_cuts_multi_token_step(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog.")
    k_ref, text_ref = _reference_stop(tok, ids, "brown", include=False)
    assert k_ref < len(ids)
    detok = make_detok(tok, tok.encode("Hi"), stop=["lazy", "brown"])
    assert detok.update(ids, stop_terminated=False) == "brown"
    assert detok.output_token_ids == ids[:k_ref]
    assert detok.output_text == text_ref


def test_hold_back_buffer_in_streamed_deltas(tok: Tokenizer) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    stop = "lazy cat"  # its prefix "lazy " appears, the stop string never does
    held = len(stop) - 1
    detok = make_detok(tok, tok.encode("Hi"), stop=[stop])
    streamed = ""
    for i, t in enumerate(ids):
        done = i == len(ids) - 1
        assert detok.update([t], stop_terminated=False, finished=done) is None
        streamed += detok.get_next_output_text(finished=done, delta=True)
        full_so_far = tok.decode(ids[:i + 1])
        visible = full_so_far if done else full_so_far[:max(0, len(full_so_far) - held)]
        assert streamed == visible
        assert detok.get_next_output_text(finished=done, delta=False) == visible
    assert streamed == text


@pytest.mark.parametrize("include", [False, True])
def test_stop_terminated_token_text(tok: Tokenizer, include: bool) -> None:
    body = tok.encode("héllo wörld")
    eos = tok.eos_token_id
    assert eos is not None
    detok = make_detok(tok, tok.encode("Hi"), include_stop_str_in_output=include)
    assert detok.update(body + [eos], stop_terminated=True) is None
    assert detok.output_text == "héllo wörld"  # special EOS skipped either way
    assert detok.output_token_ids == body + [eos]
    # A non-special stop token's text is part of the output only with include_stop_str_in_output.
    dot = tok.encode(".", add_special_tokens=False)
    assert len(dot) == 1
    detok = make_detok(tok, tok.encode("Hi"), include_stop_str_in_output=include, stop_token_ids=dot)
    detok.update(body + dot, stop_terminated=True)
    assert detok.output_text == "héllo wörld" + ("." if include else "")
    assert detok.output_token_ids == body + dot


def test_min_tokens_defers_stop_strings(tok: Tokenizer) -> None:
    head, tail = tok.encode("fox fox"), tok.encode(" fox fox")
    ids = head + tail
    detok = make_detok(tok, tok.encode("Hi"), stop=["fox"], min_tokens=len(head), max_tokens=50)
    hit = None
    for t in ids:
        hit = detok.update([t], stop_terminated=False)
        if hit:
            break
    assert hit == "fox"
    # The first stop string after min_tokens: the one in the tail.
    k_ref, _ = _reference_stop(tok, tail, "fox", include=False)
    assert detok.num_output_tokens == len(head) + k_ref
    assert detok.output_text == "fox fox "


def test_no_tokenizer_tracks_ids_only() -> None:
    detok = make_detok(None, [1, 2, 3])
    assert detok.update([5, 6], stop_terminated=False) is None
    assert detok.update([7], stop_terminated=True, finished=True) is None
    assert detok.output_token_ids == [5, 6, 7]
    assert detok.output_text == ""
    assert detok.get_next_output_text(finished=True, delta=True) == ""


def test_check_stop_strings_earliest_match() -> None:
    # "bc" starts before "cd" in the new text: the earliest match wins, whatever the list order.
    assert check_stop_strings("xxabcd", 4, ["cd", "bc"], False) == ("bc", 3)
    assert check_stop_strings("xxabcd", 4, ["cd", "bc"], True) == ("bc", 5)
    # A match entirely inside old text is not looked at again.
    assert check_stop_strings("bcxxxx", 2, ["bc"], False) is None
    # A match straddling old and new text is found.
    assert check_stop_strings("xxxbc", 1, ["bc"], False) == ("bc", 3)
