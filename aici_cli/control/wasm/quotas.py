"""What one sequence's guest may leave in its result line and ask of the vocabulary, within
its `GuestLimits`: its logs (`host.log`), its outputs (`host.set-output`) and its distinct
`tokens-matching` patterns.

Logs are cut with a note (they are for people, and the head is what explains a failure);
outputs past their caps are a precise error that ends the guest (they are data a program
reads, and silently cut data would be worse than none); a pattern past its caps is the
guest's `err`, which it may handle. The line's shared storage and outputs are
`control/line_scope.py`'s.
"""

from __future__ import annotations

import json
from typing import Any

from aici_cli.control.wasm.faults import Fault, clip
from aici_cli.control.wasm.limits import GuestLimits
from aici_cli.core.errors import ControllerError
from aici_cli.core.units import byte_size


class GuestQuotas:
    """One sequence's logs, outputs and patterns so far. One thread at a time, as its
    guest instance."""

    def __init__(self, limits: GuestLimits) -> None:
        self.logs: list[str] = []  # host.log lines, in order (cut at GuestLimits.log_bytes)
        self.outputs: dict[str, Any] = {}  # set-output values, JSON-parsed when they parse
        self._limits = limits
        self._log_used = 0
        self._log_cut = False
        self._output_used = 0  # bytes of key + value text of the current outputs
        self._output_sizes: dict[str, int] = {}
        self._patterns: set[str] = set()  # distinct tokens-matching patterns asked for

    def log(self, message: str) -> None:
        """Keeps lines up to `log_bytes` (each line counts its newline, so floods of empty
        lines are bounded too); the line that crosses the cap keeps its head."""
        if self._log_cut:
            return
        data = message.encode("utf-8", "replace")
        room = self._limits.log_bytes - self._log_used
        if len(data) + 1 > room:
            self._log_cut = True
            if room > 1:
                self.logs.append(data[: room - 1].decode("utf-8", "ignore"))
            self.logs.append(f"[logs truncated: more than {self._limits.log_bytes} bytes]")
            return
        self._log_used += len(data) + 1
        self.logs.append(message)

    def set_output(self, key: str, value: str) -> None:
        """Raises `Fault` (too_many_outputs, outputs_too_large) past the output caps."""
        limits = self._limits
        if key not in self.outputs and len(self.outputs) >= limits.max_outputs:
            raise Fault(
                ControllerError(
                    "too_many_outputs",
                    f"set-output {clip(key, 100)!r}: more than {limits.max_outputs} outputs "
                    "per sequence",
                )
            )
        size = len(key.encode("utf-8", "replace")) + len(value.encode("utf-8", "replace"))
        used = self._output_used - self._output_sizes.get(key, 0) + size
        if used > limits.output_bytes:
            raise Fault(
                ControllerError(
                    "outputs_too_large",
                    f"set-output {clip(key, 100)!r}: the outputs would take {used:,} bytes "
                    f"of key and value text, more than the {byte_size(limits.output_bytes)} "
                    "allowed per sequence",
                )
            )
        self._output_used = used
        self._output_sizes[key] = size
        try:
            self.outputs[key] = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or nested past Python's stack
            self.outputs[key] = value

    def count_pattern(self, pattern: str) -> None:
        """Raises ValueError (the guest's `err`) past the per-sequence pattern caps."""
        limits = self._limits
        if len(pattern) > limits.pattern_chars:
            raise ValueError(
                f"pattern of {len(pattern):,} characters; at most {limits.pattern_chars:,} "
                "are allowed"
            )
        if pattern not in self._patterns:
            if len(self._patterns) >= limits.max_patterns:
                raise ValueError(
                    f"more than {limits.max_patterns} distinct patterns per sequence "
                    "(each one scans the vocabulary); reuse the handles you have"
                )
            self._patterns.add(pattern)
