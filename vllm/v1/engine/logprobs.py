"""LogprobsProcessor: turns each step's LogprobsLists slice into vLLM's per-token logprob dicts.

Row p of a slice is one generated position: column 0 is the sampled token, columns 1..N the top N tokens in rank
order. Invariants: one dict per generated token kept in the output (aligned with the token ids); the sampled
token is always in its dict with its vocabulary rank; top tokens get ranks 1..N; `cumulative_logprob` is the sum
of the sampled tokens' logprobs over the kept tokens. A streamed (DELTA) request holds only the dicts not handed
out yet (`last` hands them out): an API server streaming to 1024 clients otherwise keeps ~1M dicts and Logprobs
alive, which every full garbage collection walks (up to ~0.1 s each).
"""

from __future__ import annotations

from vllm.logprobs import FlatLogprobs
from vllm.outputs import Logprob, SampleLogprobs
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.transformers_utils.tokenizer import Tokenizer
from vllm.v1.engine import PromptLogprobs
from vllm.v1.outputs import LogprobsLists


class LogprobsProcessor:
    """Per-request logprobs state: the dicts so far and the cumulative logprob (None when not requested)."""

    def __init__(self, tokenizer: Tokenizer | None, num_logprobs: int | None, delta: bool = False) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        # All the dicts so far, or (delta) those not handed out yet.
        self.logprobs: SampleLogprobs | None = None if num_logprobs is None else []
        self.cumulative_logprob: float | None = None if num_logprobs is None else 0.0
        self.delta = delta

    @classmethod
    def from_new_request(cls, tokenizer: Tokenizer | None, params: SamplingParams) -> LogprobsProcessor:
        kind = FlatLogprobsProcessor if params.flat_logprobs else cls
        return kind(tokenizer if params.detokenize else None, params.logprobs,
                    params.output_kind == RequestOutputKind.DELTA)

    def update(self, new_logprobs: LogprobsLists | None, num_positions: int | None = None) -> None:
        """Append the dicts of the step's first `num_positions` positions (all of them when None)."""
        if self.logprobs is None or new_logprobs is None:
            return
        token_ids, logprobs, ranks, n = _rows(new_logprobs, num_positions)
        assert self.cumulative_logprob is not None
        tokenizer = self.tokenizer
        for p in range(n):
            row_ids: list[int] = token_ids[p]
            row_logprobs: list[float] = logprobs[p]
            self.cumulative_logprob += row_logprobs[0]
            self.logprobs.append(_make_logprob_dict(
                row_ids, row_logprobs, tokenizer.decode_each(row_ids) if tokenizer is not None else None,
                int(ranks[p])))

    def last(self, num_new: int) -> SampleLogprobs | None:
        """The dicts of the last `num_new` tokens (a delta output); a DELTA processor hands them out (it holds the
        dicts of exactly the tokens not handed out yet, and none after)."""
        if self.logprobs is None:
            return None
        out = self.logprobs[len(self.logprobs) - num_new:] if num_new else []
        if self.delta:
            self.logprobs = []
        return out


class FlatLogprobsProcessor(LogprobsProcessor):
    """LogprobsProcessor for SamplingParams.flat_logprobs: the same positions, kept in one FlatLogprobs."""

    def __init__(self, tokenizer: Tokenizer | None, num_logprobs: int | None, delta: bool = False) -> None:
        super().__init__(tokenizer, num_logprobs, delta)
        self.logprobs: FlatLogprobs | None = None if num_logprobs is None else FlatLogprobs()  # type: ignore[assignment]

    def update(self, new_logprobs: LogprobsLists | None, num_positions: int | None = None) -> None:
        flat = self.logprobs
        if flat is None or new_logprobs is None:
            return
        token_ids, logprobs, ranks, n = _rows(new_logprobs, num_positions)
        assert self.cumulative_logprob is not None
        tokenizer = self.tokenizer
        for p in range(n):
            row_ids: list[int] = token_ids[p]
            row_logprobs: list[float] = logprobs[p]
            self.cumulative_logprob += row_logprobs[0]
            # The sampled token's vocabulary rank, then the top N's ranks 1..N (as _make_logprob_dict gives them).
            flat.append_position(row_ids, row_logprobs, [int(ranks[p]), *range(1, len(row_ids))],
                                 tokenizer.decode_each(row_ids) if tokenizer is not None else None)

    def last(self, num_new: int) -> FlatLogprobs | None:  # type: ignore[override]
        flat = self.logprobs
        if flat is None:
            return None
        out = flat[len(flat) - num_new:] if num_new else FlatLogprobs()
        if self.delta:
            self.logprobs = FlatLogprobs()  # type: ignore[assignment]
        return out  # type: ignore[return-value]


def _rows(new_logprobs: LogprobsLists, num_positions: int | None) -> tuple[list, list, list, int]:
    """A step slice's (token ids, logprobs, ranks) rows as lists, and how many of its positions to take."""
    token_ids, logprobs, ranks = new_logprobs.logprob_token_ids, new_logprobs.logprobs, \
        new_logprobs.sampled_token_ranks
    n = len(token_ids) if num_positions is None else min(num_positions, len(token_ids))
    # NOTE: rows are numpy arrays in the engine's own process and Python lists after the trip from the
    # engine-core process (serial_utils.unpack_step_arrays).
    if not isinstance(token_ids, list):
        token_ids, logprobs, ranks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    return token_ids, logprobs, ranks, n


def _make_logprob_dict(token_ids: list[int], logprobs: list[float], decoded: list[str] | None,
                       sampled_rank: int) -> dict[int, Logprob]:
    """{token id: Logprob} for one position; the top-N entries come after the sampled one. `decoded`: the
    tokens' texts, or None (no tokenizer: no text).

    NOTE: when the sampled token is also among the top N, its top-N entry (same logprob) replaces the first one,
    so its rank is its position in the top N (equal to the vocabulary rank unless logprobs tie).
    NOTE: a plain loop, positional Logprobs: a third of the cost of the dict comprehension over zipped lists,
    once per generated token.
    """
    if not token_ids:
        return {}
    out = {token_ids[0]: Logprob(logprobs[0], sampled_rank, decoded[0] if decoded is not None else None)}
    for k in range(1, len(token_ids)):
        out[token_ids[k]] = Logprob(logprobs[k], k, decoded[k] if decoded is not None else None)
    return out


def make_prompt_logprobs(plp: PromptLogprobs, tokenizer: Tokenizer | None,
                         flat: bool) -> list[dict[int, Logprob] | None] | FlatLogprobs:
    """vLLM's RequestOutput.prompt_logprobs from the engine's rows: None for the first prompt token, then per later
    prompt token its dict (the prompt token with its vocabulary rank, then the top k with ranks 1..k; a prompt
    token among the top k keeps its top-k entry, as for sample logprobs); a FlatLogprobs with `flat`."""
    token_ids, logprobs, ranks = plp.token_ids, plp.logprobs, plp.ranks
    if not isinstance(token_ids, list):
        token_ids, logprobs, ranks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    out: list[dict[int, Logprob] | None] | FlatLogprobs = FlatLogprobs() if flat else []
    out.append(None)
    # NOTE: one batch decode for the whole prompt, not one per position.
    all_decoded = tokenizer.decode_each([t for row in token_ids for t in row]) if tokenizer is not None else None
    pos = 0
    for row_ids, row_logprobs, rank in zip(token_ids, logprobs, ranks):
        decoded = None
        if all_decoded is not None:
            decoded = all_decoded[pos:pos + len(row_ids)]
            pos += len(row_ids)
        if isinstance(out, FlatLogprobs):
            out.append_position(row_ids, row_logprobs, [rank, *range(1, len(row_ids))], decoded)
        else:
            out.append(_make_logprob_dict(row_ids, row_logprobs, decoded, rank))
    return out
