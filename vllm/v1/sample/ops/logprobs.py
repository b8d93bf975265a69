"""Logprobs output of a step: the sampled token's value and rank plus the top-N of the chosen values.

Invariants: column 0 of every [num_reqs, N+1] tensor is the sampled token, columns 1..N the N largest values
of the row (descending; ties in torch.topk's order). The rank is 1 + the number of vocabulary entries whose
value is strictly greater than the sampled token's, so equal values share the better rank.
"""

from __future__ import annotations

import torch

from vllm.v1.outputs import LogprobsTensors


def gather_logprobs(values: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor) -> LogprobsTensors:
    """values: [num_reqs, V] float32 (logprobs or logits); token_ids: [num_reqs] int64 sampled tokens."""
    token_ids = token_ids.to(torch.long)[:, None]  # [num_reqs, 1]
    sampled_values = values.gather(1, token_ids)  # [num_reqs, 1]
    ranks = (values > sampled_values).sum(dim=-1).add_(1)  # [num_reqs]
    if num_logprobs > 0:
        top_values, top_ids = values.topk(num_logprobs, dim=-1)  # [num_reqs, N]
        ids = torch.cat([token_ids, top_ids], dim=1)
        logprobs = torch.cat([sampled_values, top_values], dim=1)
    else:
        ids, logprobs = token_ids, sampled_values
    return LogprobsTensors(ids.to(torch.int32), logprobs.to(torch.float32), ranks.to(torch.int32))
