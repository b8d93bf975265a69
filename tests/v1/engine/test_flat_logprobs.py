"""SamplingParams(flat_logprobs=True): the same sample logprobs as the list of dicts, held in one FlatLogprobs.

References: the dicts built by hand from float64 log_softmax (test_output_processor's `expected_logprob_dict`),
for every output kind, merged steps and a stop string that cuts a step; FlatLogprobs' list behaviour against a
plain list of the same dicts; offline generation with and without the flag (same seed) on the bundled model.
"""

from __future__ import annotations

import math

import pytest
from test_output_processor import TEXT, expected_logprob_dict, make_output, make_positions, make_request, tok

from vllm.logprobs import FlatLogprobs
from vllm.outputs import Logprob
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer
from vllm.v1.engine import FinishReason
from vllm.v1.engine.output_processor import OutputProcessor

__all__ = ["tok"]  # the tokenizer fixture, shared


def dicts() -> list[dict[int, Logprob] | None]:
    return [{5: Logprob(-0.5, 3, "a"), 9: Logprob(-0.1, 1, "b")}, None, {},
            {7: Logprob(-1.25, 1, None)}, {2: Logprob(-2.0, 4, "x"), 3: Logprob(-0.3, 1, "y"), 4: Logprob(-0.9, 2, None)}]


def test_flat_logprobs_reads_as_the_list_of_dicts() -> None:
    ref = dicts()
    flat = FlatLogprobs()
    flat.extend(ref)
    assert len(flat) == len(ref) and list(flat) == ref and flat == ref
    assert [flat[p] for p in range(-len(ref), len(ref))] == ref + ref
    for s in (slice(None), slice(1, 4), slice(2, None), slice(-2, None), slice(0, 0), slice(None, None, 2),
              slice(None, None, -1), slice(3, 1)):
        part = flat[s]
        assert isinstance(part, FlatLogprobs) and list(part) == ref[s], s
    joined = FlatLogprobs()
    joined.extend(flat[:2])
    joined.extend(flat[2:])
    joined.append(None)
    assert list(joined) == ref + [None]
    with pytest.raises(IndexError):
        flat[len(ref)]
    for mutate in (lambda: flat.__setitem__(0, {}), lambda: flat.__delitem__(0), lambda: flat.insert(0, {})):
        with pytest.raises(TypeError, match="append-only"):
            mutate()
    assert list(flat) == ref


def test_a_token_listed_twice_keeps_its_first_place_with_its_later_entry() -> None:
    """As the engine's dicts do when the sampled token is also among the top N (logprob_token_ids [t, t, u])."""
    flat = FlatLogprobs()
    flat.append_position([4, 4, 8], [-0.2, -0.2, -1.5], [1, 1, 2], None)
    assert flat[0] == {4: Logprob(-0.2, 1, None), 8: Logprob(-1.5, 2, None)} and list(flat[0]) == [4, 8]


@pytest.mark.parametrize("kind", [RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA,
                                  RequestOutputKind.FINAL_ONLY], ids=["cumulative", "delta", "final"])
def test_flat_outputs_hold_the_dicts_of_every_kind(tok: Tokenizer, kind: RequestOutputKind) -> None:
    """Merged steps (1-3 positions) and a stop string inside the last step: every output's logprobs equal the
    hand-built dicts of its tokens, and the cumulative logprob is the sampled tokens' sum."""
    ids = tok.encode(TEXT)
    positions = make_positions(ids, tok.vocab_size, num_logprobs=2, seed=11)
    k = next(k for k in range(1, len(ids) + 1) if "lazy" in tok.decode(ids[:k]))
    proc = OutputProcessor(tok, log_stats=False)
    proc.add_request(make_request("f", [5], logprobs=2, stop=["lazy"], output_kind=kind, flat_logprobs=True,
                                  max_tokens=100), prompt=None)
    steps, i = [], 0
    for n in [1, 3, 2, 1, 3] * 10:
        if i >= k + 2:
            break
        steps.append(positions[i:i + n])
        i += n
    outputs = []
    state = proc.request_states["f"]
    for chunk in steps:
        outputs += proc.process_outputs([make_output("f", chunk)]).request_outputs
        if kind == RequestOutputKind.DELTA:  # what it handed out, it keeps no more
            assert len(state.logprobs_processor.logprobs) == 0
        if outputs and outputs[-1].finished:
            break
    assert outputs[-1].finished and outputs[-1].outputs[0].stop_reason == "lazy"
    want = [expected_logprob_dict(tok, p) for p in positions[:k]]
    got = [o.outputs[0].logprobs for o in outputs]
    assert all(isinstance(g, FlatLogprobs) for g in got)
    if kind == RequestOutputKind.DELTA:
        assert [d for g in got for d in g] == want
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == k
    else:
        for o, g in zip(outputs, got):
            assert g == want[:len(o.outputs[0].token_ids)]
        assert outputs[-1].outputs[0].token_ids == ids[:k]
    assert outputs[-1].outputs[0].cumulative_logprob == pytest.approx(
        math.fsum(p.logprobs[0] for p in positions[:k]), abs=1e-4)
    if kind == RequestOutputKind.FINAL_ONLY:
        assert len(outputs) == 1


def test_offline_generation_with_and_without_flat_logprobs() -> None:
    from vllm import LLM

    llm = LLM(device="cpu", max_num_seqs=4, max_model_len=128)
    prompts = [{"prompt_token_ids": [5, 17, 42, 9]}, "The function"]

    def run(flat: bool) -> list:
        params = SamplingParams(temperature=1.0, top_k=20, seed=3, max_tokens=10, ignore_eos=True, logprobs=3,
                                flat_logprobs=flat)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    plain, flat = run(False), run(True)
    for p, f in zip(plain, flat):
        assert f.token_ids == p.token_ids and isinstance(f.logprobs, FlatLogprobs) and isinstance(p.logprobs, list)
        assert len(f.logprobs) == len(f.token_ids) == 10
        assert f.logprobs == p.logprobs and f.cumulative_logprob == p.cumulative_logprob
        # The sampled token is in its position's dict (first) with its rank.
        assert all(next(iter(d)) == t for d, t in zip(f.logprobs, f.token_ids))
