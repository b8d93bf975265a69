"""Exceptions users catch by vLLM's names.

`VLLMValidationError` is what every request check raises (SamplingParams, the input processor, the OpenAI request
models): a `ValueError`, so code that catches ValueError keeps working, carrying the name of the offending field
(`parameter`) and the value refused (`value`). The HTTP server turns it into a 400 whose OpenAI error body has
`param` set to that name.
"""

from __future__ import annotations

from typing import Any

# A value longer than this is cut in the message (a client controls it: a huge stop list, a long prompt).
_MAX_VALUE_CHARS = 120


class VLLMValidationError(ValueError):
    """A request failed validation. `parameter` names the field (None when no one field is at fault) and `value`
    is what was refused; both are appended to the message as vLLM does: `"... (parameter=top_p, value=1.5)"`."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        base = super().__str__()
        extras = []
        if self.parameter is not None:
            extras.append(f"parameter={self.parameter}")
        if self.value is not None:
            text = repr(self.value) if isinstance(self.value, str) else str(self.value)
            if len(text) > _MAX_VALUE_CHARS:
                text = text[:_MAX_VALUE_CHARS] + "..."
            extras.append(f"value={text}")
        return f"{base} ({', '.join(extras)})" if extras else base
