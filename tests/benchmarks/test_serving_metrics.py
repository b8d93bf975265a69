"""benchmarks/serving_metrics.py: a request's record from its SSE events (both mask checks), and the metric
arithmetic of one level on hand-made records."""

from __future__ import annotations

import os
import sys

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "benchmarks"))
import serving_metrics as sm  # noqa: E402


def test_chunk_token_count_prefers_explicit_fields() -> None:
    assert sm.chunk_token_count({"token_ids": [1, 2, 3], "logprobs": {"tokens": ["a"]}}) == 3
    assert sm.chunk_token_count({"token_ids": None, "logprobs": {"tokens": ["a", "b"]}, "text": ""}) == 2
    assert sm.chunk_token_count({"logprobs": None, "sampling_mask": [[1], [2, 3]], "text": ""}) == 2
    assert sm.chunk_token_count({"text": "hi"}) == 1
    assert sm.chunk_token_count({"text": ""}) == 0


@pytest.mark.parametrize("payload", [
    b'{"choices":[{"index":0,"text":"","token_ids":[5,9],"logprobs":null,"sampling_mask":[[1,2,30],[7]]}],'
    b'"usage":null}',
    b'{"choices":[{"index":0,"text":"ab","logprobs":{"tokens":["a"]},"sampling_mask":[[]]}],"usage":null}',
    b'{"choices":[],"usage":{"completion_tokens":4,"prompt_tokens":2}}',
    b'{"choices":[{"index":0,"text":"x","sampling_mask":null}],"usage":null}',
    b'{"error":{"message":"bad","code":400}}',
])
def test_mask_check_count_accounts_events_as_parse_does(payload: bytes) -> None:
    """--mask-check count (raw masks, ids counted by commas) records what the full parse records."""
    parsed, counted = sm.RequestRecord(), sm.RequestRecord()
    assert sm._handle_event(payload, parsed, "parse") == sm._handle_event(payload, counted, "count")
    for rec in (parsed, counted):
        rec.first_token = rec.first_token is not None  # timestamps differ by the call's time
    assert counted == parsed
    assert sm._handle_event(b"[DONE]", counted, "count")


def test_summarize_hand_worked_level() -> None:
    # Two finished requests of 5 tokens and one cut short after 2 tokens, over a 10 s level.
    a = sm.RequestRecord(start=100.0, first_token=100.5, end=102.5, chunk_tokens=5, usage_tokens=5, masks=5,
                         mask_ids=20, has_mask=True)
    b = sm.RequestRecord(start=101.0, first_token=102.0, end=106.0, chunk_tokens=5, usage_tokens=5, masks=4,
                         mask_ids=12, has_mask=True)
    c = sm.RequestRecord(start=106.0, first_token=107.0, end=110.0, chunk_tokens=2, error="timeout")
    s = sm.summarize([a, b, c], start=100.0, end=110.0, concurrency=2, input_len=7)
    assert s["completed"] == 2 and s["timed_out"] == 1 and s["failed"] == 0 and s["truncated"]
    assert s["output_tokens"] == 12
    assert s["output_throughput"] == pytest.approx(1.2)
    assert s["request_throughput"] == pytest.approx(0.2)
    assert s["total_token_throughput"] == pytest.approx((12 + 14) / 10)
    # TTFTs 500, 1000, 1000 ms; TPOTs (102.5 - 100.5) / 4 = 500 ms and (106 - 102) / 4 = 1000 ms.
    assert s["ttft_ms_median"] == pytest.approx(1000.0)
    assert s["tpot_ms_median"] == pytest.approx(750.0)
    assert s["e2e_ms_median"] == pytest.approx(3750.0)
    assert s["mask_requests"] == 2 and s["masks_received"] == 9
    assert s["mask_count_mismatches"] == 1 and s["masks_ok"] is False
    assert s["mean_mask_size"] == pytest.approx(32 / 9)
    # Steady state over [102, 108]: a's 5 tokens spread over [100.5, 102.5] put 1.25 in it, b's 5 over [102, 106]
    # all 5, c's 2 received over [107, 110] (cut at the level's end) 2/3.
    assert s["steady_output_throughput"] == pytest.approx((1.25 + 5 + 2 / 3) / 6)
