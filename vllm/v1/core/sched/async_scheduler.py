"""AsyncScheduler: schedules step N+1 before step N's sampled tokens are known (async scheduling).

A request that samples in a scheduled step gets an output placeholder: a token that exists on the device
(the runner feeds it into the next step's input ids) but not yet here. The next step already schedules it,
as if the request had `num_tokens + placeholders` tokens. When the step's output arrives, its tokens replace
the placeholders.

Invariants (on top of Scheduler's):
- `request.num_output_placeholders ==` the number of scheduled steps not yet processed in which the request
  samples; with the engine's two-deep batch queue it is 0, 1 or 2.
- A request that stopped in step N was computed once more in N+1; that token is discarded (the request is
  gone from `requests` when N+1's output arrives).
- A request preempted while one of its steps is in flight gets that step's token when it arrives (possibly
  finishing it while it waits); it is resumed only after that (preemption blocks admission in its own step).
- A request whose in-flight tokens reach max_tokens or max_model_len is not scheduled again: they finish it.
- A request's sampled tokens never outnumber its placeholders (asserted): it samples only in steps it was
  expected to.

The count is `Request.num_output_placeholders`, and Scheduler's own schedule() and update_from_output() loops
keep it (under `tracks_output_placeholders`): no per-request method call or dict lookup, since every running
request is scheduled and processed in every step.
"""

from __future__ import annotations

from vllm.v1.core.sched.scheduler import Scheduler


class AsyncScheduler(Scheduler):
    # NOTE: the placeholder accounting is Scheduler's (see its module docstring), switched on by this flag.
    tracks_output_placeholders = True
