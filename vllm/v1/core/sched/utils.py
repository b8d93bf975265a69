"""check_stop: decide, after each appended output token, whether a request has finished.

Stop conditions on the last token (EOS unless `ignore_eos`, or one of `stop_token_ids`) apply only once
`num_output_tokens >= min_tokens`; the length caps (`max_tokens`, `max_model_len`) always apply. A token that
is both a stop token and the last one allowed reports STOP (the more informative reason).
"""

from __future__ import annotations

from vllm.v1.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Set `request.status` (and `stop_reason`) and return True when the request is finished."""
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        last_token_id = request.output_token_ids[-1]
        if not params.ignore_eos and last_token_id == request.eos_token_id:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = None
            return True
        if last_token_id in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
