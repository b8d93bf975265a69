"""tools/profiling/frontend_step.py on a small step: the API server's path from the engine core's frames to SSE chunks
runs for this client's share of the requests, and the chunks carry one token with its logprobs and its mask."""

from __future__ import annotations

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tools", "profiling"))
import frontend_step  # noqa: E402


def test_frontend_step_runs_one_clients_share_with_and_without_masks() -> None:
    for mask in (False, True):
        result = frontend_step.run(num_reqs=12, num_clients=3, mask=mask, steps=1, mask_size=7, profile=False)
        assert result["outputs"] == 4  # every third request is the first client's
        assert result["total"] >= result["decode"] > 0
    # The mask arm's frames carry 12 rows of 7 ids (int32) and their text: more than the ids alone.
    assert result["kb_per_step"] * 1e3 > 12 * 7 * 4


def test_frontend_step_through_the_servers_stream_generators() -> None:
    """--streams: every request's task yields one chunk per step through stream_outputs / _stream (a stream that
    ended early would abort, which the benchmark's engine refuses)."""
    result = frontend_step.run(num_reqs=8, num_clients=2, mask=True, steps=2, mask_size=5, profile=False,
                               streams=True)
    assert result["outputs"] == 4 and result["chunks"] > 0 and result["kb_per_step"] * 1e3 > 8 * 5 * 4
