"""EngineCoreProc's busy loop, its order of work per step against a scripted engine core (no sockets): a step's
outputs are sent as soon as the step returns them; an idle core blocks for input only once everything is sent."""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.core_proc import EngineCoreProc


class ScriptedCore:
    """Runs `num_steps` steps and logs every call, like a core with only the protocol's four methods."""

    def __init__(self, num_steps: int, log: list[Any]) -> None:
        self.num_steps, self.done, self.log = num_steps, 0, log

    def has_unfinished_requests(self) -> bool:
        return self.done < self.num_steps

    def step(self) -> EngineCoreOutputs:
        self.done += 1
        self.log.append(("step", self.done))
        return EngineCoreOutputs(outputs=[EngineCoreOutput("r", [self.done])])


def _run(core: Any, log: list[Any], aborts_at: int | None = None, stops_at: int | None = None) -> None:
    """The loop until its second blocking poll (or poll number `stops_at`, a SHUTDOWN); poll number `aborts_at`
    reports an abort."""
    proc = EngineCoreProc.__new__(EngineCoreProc)  # the loop only: inputs and sends are scripted
    proc.engine_core, proc.should_stop = core, False
    polls, blocking = [0], [0]

    def process_inputs(block: bool) -> bool:
        polls[0] += 1
        blocking[0] += block
        log.append(("inputs", block))
        if blocking[0] == 2 or polls[0] == stops_at:
            proc.should_stop = True
        return polls[0] == aborts_at

    proc._process_inputs = process_inputs  # type: ignore[method-assign]
    proc.send_outputs = lambda outputs: log.append(("send", outputs.outputs[0].new_token_ids[0]))  # type: ignore
    proc.broadcast = lambda kind, payload: log.append("stats")  # type: ignore[method-assign]
    proc._stats = lambda: None  # type: ignore[method-assign]
    proc.run_busy_loop()


def test_outputs_go_out_at_once() -> None:
    """Each step's outputs are sent right after the step; an abort that arrives with
    nothing running gets a stats-only message."""
    log: list[Any] = []
    _run(ScriptedCore(2, log), log, aborts_at=3)
    assert log == [("inputs", False), ("step", 1), ("send", 1),
                   ("inputs", False), ("step", 2), ("send", 2),
                   ("inputs", True), "stats",
                   ("inputs", True)]


def test_shutdown_stops_the_loop_after_a_sent_step() -> None:
    log: list[Any] = []
    _run(ScriptedCore(3, log), log, stops_at=2)
    assert log == [("inputs", False), ("step", 1), ("send", 1), ("inputs", False)]
