"""Logprob containers (vLLM's module): `Logprob`, and `FlatLogprobs`, the compact form of a request's sample
logprobs that `SamplingParams(flat_logprobs=True)` asks for.

The default form, a list of one `{token id: Logprob}` dict per generated token, makes 2-3 Python objects per
token that the garbage collector tracks and walks (RL rollouts: millions per batch). `FlatLogprobs` keeps the
same data in six flat lists whatever the length: position p's entries are `token_ids[start:end]` (and the same
range of `logprobs`, `ranks`, `decoded_tokens`) with start, end = `start_indices[p]`, `end_indices[p]`. It reads
as the list of dicts does: `len`, `flat[p]` (the dict, built on access), slices (a FlatLogprobs), iteration, and
`==` against a list of dicts; it is append-only (item assignment, deletion and insertion raise TypeError).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import overload

from vllm.outputs import Logprob

__all__ = ["FlatLogprobs", "Logprob", "LogprobsOnePosition", "SampleLogprobs"]

LogprobsOnePosition = dict[int, Logprob]


@dataclass(eq=False)
class FlatLogprobs(MutableSequence[LogprobsOnePosition | None]):
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append_position(self, token_ids: list[int], logprobs: list[float], ranks: Iterable[int | None],
                        decoded_tokens: list[str | None] | None) -> None:
        """One position's entries (what the engine produces: the sampled token first, then the top N)."""
        self.start_indices.append(len(self.token_ids))
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.ranks += ranks
        self.decoded_tokens += decoded_tokens if decoded_tokens is not None else [None] * len(token_ids)
        self.end_indices.append(len(self.token_ids))

    def append(self, value: LogprobsOnePosition | None) -> None:
        """A position given as a dict (None: a position without logprobs, read back as None)."""
        if value is None:
            self.start_indices.append(len(self.token_ids))
            self.end_indices.append(-1)
            return
        self.append_position(list(value), [lp.logprob for lp in value.values()],
                             [lp.rank for lp in value.values()], [lp.decoded_token for lp in value.values()])

    def extend(self, values: Iterable[LogprobsOnePosition | None]) -> None:
        if isinstance(values, FlatLogprobs):
            base = len(self.token_ids)
            self.start_indices += [s + base for s in values.start_indices]
            self.end_indices += [e if e < 0 else e + base for e in values.end_indices]
            self.token_ids += values.token_ids
            self.logprobs += values.logprobs
            self.ranks += values.ranks
            self.decoded_tokens += values.decoded_tokens
            return
        for value in values:
            self.append(value)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition | None: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | None | FlatLogprobs:
        if isinstance(index, slice):
            positions = range(len(self))[index]
            out = FlatLogprobs()
            if positions.step == 1:  # one run of entries (every position's range follows the previous one's)
                ends = [e for e in (self.end_indices[p] for p in positions) if e >= 0]
                lo = self.start_indices[positions[0]] if len(positions) else 0
                hi = ends[-1] if ends else lo
                out.start_indices = [self.start_indices[p] - lo for p in positions]
                out.end_indices = [e if e < 0 else e - lo for e in (self.end_indices[p] for p in positions)]
                out.token_ids, out.logprobs = self.token_ids[lo:hi], self.logprobs[lo:hi]
                out.ranks, out.decoded_tokens = self.ranks[lo:hi], self.decoded_tokens[lo:hi]
                return out
            for p in positions:
                out.append(self[p])
            return out
        start, end = self.start_indices[index], self.end_indices[index]
        if end < 0:
            return None
        # NOTE: a plain loop, like the dicts the engine builds: a token listed twice (the sampled one among the
        # top N) keeps its first place with its later entry.
        logprobs, ranks, decoded = self.logprobs, self.ranks, self.decoded_tokens
        out: LogprobsOnePosition = {}
        for k, token_id in enumerate(self.token_ids[start:end], start):
            out[token_id] = Logprob(logprobs[k], ranks[k], decoded[k])
        return out

    def __iter__(self) -> Iterator[LogprobsOnePosition | None]:
        for p in range(len(self)):
            yield self[p]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (FlatLogprobs, list)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __setitem__(self, index: object, value: object) -> None:
        raise TypeError("FlatLogprobs is append-only: positions cannot be replaced.")

    def __delitem__(self, index: object) -> None:
        raise TypeError("FlatLogprobs is append-only: positions cannot be deleted.")

    def insert(self, index: int, value: object) -> None:
        raise TypeError("FlatLogprobs is append-only: use append.")


SampleLogprobs = list[LogprobsOnePosition] | FlatLogprobs
