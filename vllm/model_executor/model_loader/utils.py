"""vLLM's `process_weights_after_loading`, which RL worker extensions call after they load weights themselves
(`model.load_weights(...)` in a collective_rpc): here no layer keeps a form derived from its weights (no
quantization repacking, no fused copies), so there is nothing to redo and the call returns at once."""

from __future__ import annotations

from typing import Any

from torch import nn


def process_weights_after_loading(model: nn.Module, model_config: Any = None, target_device: Any = None) -> None:
    """Nothing to do: every parameter is used as it was loaded."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"process_weights_after_loading takes the model (an nn.Module), got {type(model).__name__}.")
