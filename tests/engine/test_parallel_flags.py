"""vLLM's short forms of the parallel-size flags (-tp, -pp, -dp) parse to the same fields as the long ones."""

from __future__ import annotations

import argparse

import pytest

from vllm.engine.arg_utils import AsyncEngineArgs


@pytest.mark.parametrize("flags, field, value", [
    (["-tp", "2"], "tensor_parallel_size", 2), (["--tensor-parallel-size", "4"], "tensor_parallel_size", 4),
    (["-pp", "1"], "pipeline_parallel_size", 1), (["-dp", "3"], "data_parallel_size", 3),
])
def test_short_and_long_parallel_flags(flags: list[str], field: str, value: int) -> None:
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    assert getattr(parser.parse_args(flags), field) == value


def test_short_flags_together() -> None:
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["-tp", "2", "-dp", "2", "-pp", "1"])
    assert (ns.tensor_parallel_size, ns.data_parallel_size, ns.pipeline_parallel_size) == (2, 2, 1)
