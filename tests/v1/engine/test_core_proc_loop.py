"""EngineCoreProc's busy loop, its order of work per step against a scripted engine core (no sockets): a step's
outputs are sent after the inputs that arrived meanwhile were applied and after `launch_ahead`, never lost when
the core goes idle, and an idle core blocks for input only once everything is sent."""

from __future__ import annotations

from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.engine.core_proc import EngineCoreProc


class ScriptedCore:
    """Runs `num_steps` steps and logs every call; has no `launch_ahead`, like a core with only the protocol's
    four methods."""

    def __init__(self, num_steps: int, log: list[Any]) -> None:
        self.num_steps, self.done, self.log = num_steps, 0, log

    def has_unfinished_requests(self) -> bool:
        return self.done < self.num_steps

    def step(self) -> EngineCoreOutputs:
        self.done += 1
        self.log.append(("step", self.done))
        return EngineCoreOutputs(outputs=[EngineCoreOutput("r", [self.done])])


class AheadCore(ScriptedCore):
    def launch_ahead(self) -> None:
        self.log.append("ahead")


def _run(core: Any, log: list[Any], aborts_at: int | None = None) -> None:
    proc = EngineCoreProc.__new__(EngineCoreProc)  # the loop only: inputs and sends are scripted
    proc.engine_core, proc.should_stop = core, False
    proc.launch_ahead = getattr(core, "launch_ahead", lambda: None)
    polls = [0]

    def process_inputs(block: bool) -> bool:
        polls[0] += 1
        log.append(("inputs", block))
        if block:  # idle: the test ends here
            proc.should_stop = True
        return polls[0] == aborts_at

    proc._process_inputs = process_inputs  # type: ignore[method-assign]
    proc.send_outputs = lambda outputs: log.append(("send", outputs.outputs[0].new_token_ids[0]))  # type: ignore
    proc.broadcast = lambda kind, payload: log.append("stats")  # type: ignore[method-assign]
    proc._stats = lambda: None  # type: ignore[method-assign]
    proc._busy_loop(None, None, None)


def test_outputs_are_sent_after_the_next_launch() -> None:
    log: list[Any] = []
    _run(AheadCore(3, log), log)
    assert log == [("inputs", False), ("step", 1),
                   ("inputs", False), "ahead", ("send", 1), ("step", 2),
                   ("inputs", False), "ahead", ("send", 2), ("step", 3),
                   # the core is idle now, but step 3's outputs are still to go: no blocking poll before them
                   ("inputs", False), ("send", 3),
                   ("inputs", True)]


def test_core_without_launch_ahead_and_an_abort_while_idle() -> None:
    """A core without `launch_ahead` (the protocol's four methods) sends each step's outputs on the next turn;
    an abort that arrives with nothing running gets a stats-only message."""
    log: list[Any] = []
    _run(ScriptedCore(2, log), log, aborts_at=3)
    assert log == [("inputs", False), ("step", 1),
                   ("inputs", False), ("send", 1), ("step", 2),
                   ("inputs", False), ("send", 2), "stats",
                   ("inputs", True)]
