"""Drawing tokens: the exponential race over probabilities, with per-row generators for seeded requests.

argmax_i(p_i / q_i) with q_i ~ Exp(1) i.i.d. picks token i with probability p_i. Rows listed in `generators`
draw their q from their own generator (V numbers per step), so a seeded request samples the same tokens
whatever else is in the batch; all other rows share the default generator.
"""

from __future__ import annotations

import torch


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """probs: [num_reqs, V] float32 (consumed in place) -> [num_reqs] int64 sampled ids."""
    q = torch.empty_like(probs)  # [num_reqs, V]
    if len(generators) < probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    # NOTE: a draw of exactly 0 would make 0/0 = NaN win the argmax for a removed token.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)
