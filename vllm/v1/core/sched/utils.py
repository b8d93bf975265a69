"""Stop checking: decide, after each appended output token, whether a request has finished.

Stop conditions on the last token (EOS unless `ignore_eos`, or one of `stop_token_ids`) apply only once
`num_output_tokens >= min_tokens`; the length caps (`max_tokens`, `max_model_len`) always apply. A token that
is both a stop token and the last one allowed reports STOP (the more informative reason).

`check_stop` is the definition (it sets the finished status and stop reason); `append_sampled` appends a step's
sampled tokens up to the first one that finishes the request, testing each token with the same conditions in
their cheap form and calling `check_stop` only for the token that finishes it.
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


def append_sampled(request: Request, sampled: list[int], max_model_len: int) -> tuple[list[int], bool]:
    """Append `sampled` to the request's tokens up to and including the first token that finishes it.

    Returns the appended tokens (a new list) and whether the request finished (its status and stop reason then
    set by `check_stop`). Equivalent to appending the tokens one at a time and calling `check_stop` after each.
    """
    output_ids = request.output_token_ids
    all_ids = request.all_token_ids
    num_new = len(sampled)
    num_output = len(output_ids)
    end = num_output + num_new
    stop_ids = request.stop_check_token_ids
    min_tokens = request.min_tokens
    if (end < request.max_tokens and len(all_ids) + num_new < max_model_len
            and (end < min_tokens or stop_ids.isdisjoint(sampled))):
        # NOTE: the common case, tested for all the tokens at once: none of them reaches a length cap or (from
        # min_tokens outputs on) is a stop token, so none finishes the request.
        new_token_ids = sampled[:]
        output_ids += new_token_ids
        all_ids += new_token_ids
        return new_token_ids, False
    # Token i (1-based, counted over all outputs) finishes the request when i reaches the length cap, or, from
    # min_tokens outputs on, when it is EOS (unless ignore_eos) or a stop token: check_stop's conditions.
    length_cap = min(request.max_tokens, max_model_len - request.num_prompt_tokens)
    finished = False
    for i, token_id in enumerate(sampled, num_output + 1):
        if i >= length_cap or (token_id in stop_ids and i >= min_tokens):
            num_new = i - num_output
            finished = True
            break
    new_token_ids = sampled[:num_new]
    output_ids += new_token_ids
    all_ids += new_token_ids
    if finished:
        stopped = check_stop(request, max_model_len)
        assert stopped, f"request {request.request_id!r}: append_sampled and check_stop disagree"
    return new_token_ids, finished
