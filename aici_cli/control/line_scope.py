"""What the sequences of one input line share: its storage and its own outputs.

A controller that forks (`aici:controller@0.2.0`) runs one guest per branch; the branches
of a line (and its `n` samples) share one `LineScope`: a key-value storage
(`aici:storage/storage`) and the line's `outputs` (`host.set-line-output`). The host calls
one guest at a time, so a write applies at once and every later call of any of the
line's guests sees it (docs/controllers.md, "Storage", gives the order of calls).

Both are bounded like a sequence's outputs, with a precise error rather than silent loss:
storage by keys and by bytes of key and value, `storage_quota` beyond them; the line's
outputs by `too_many_outputs` / `outputs_too_large`. The caller passes the caps (the
component's `GuestLimits`), so this module needs neither wasmtime nor torch.
"""

from __future__ import annotations

import json
from typing import Any

from aici_cli.core.errors import ControllerError
from aici_cli.core.units import byte_size


def _shown(key: str) -> str:
    return repr(key if len(key) <= 100 else key[:100] + "...")


class LineScope:
    """One line's storage and outputs. Not thread-safe: one guest call at a time."""

    def __init__(self) -> None:
        self.storage: dict[str, bytes] = {}
        self.storage_bytes = 0  # UTF-8 bytes of every key plus its value's bytes
        self.outputs: dict[str, Any] = {}  # set-line-output values, JSON-parsed when they parse
        self._output_sizes: dict[str, int] = {}
        self._output_bytes = 0

    # -- storage --

    def get(self, key: str) -> bytes | None:
        return self.storage.get(key)

    def set(self, key: str, value: bytes, max_keys: int, max_bytes: int) -> None:
        self._put("set", key, bytes(value), max_keys, max_bytes)

    def append(self, key: str, value: bytes, max_keys: int, max_bytes: int) -> int:
        """Appends to the key's value (empty if unset); returns the new length in bytes."""
        new = self.storage.get(key, b"") + bytes(value)
        self._put("append", key, new, max_keys, max_bytes)
        return len(new)

    def _put(self, op: str, key: str, value: bytes, max_keys: int, max_bytes: int) -> None:
        key_bytes = len(key.encode("utf-8", "replace"))
        old = self.storage.get(key)
        if old is None and len(self.storage) >= max_keys:
            raise ControllerError(
                "storage_quota",
                f"storage {op} {_shown(key)}: more than {max_keys} keys per line",
            )
        used = self.storage_bytes - (0 if old is None else key_bytes + len(old))
        used += key_bytes + len(value)
        if used > max_bytes:
            raise ControllerError(
                "storage_quota",
                f"storage {op} {_shown(key)}: the line's storage would hold {used:,} bytes of "
                f"keys and values, more than the {byte_size(max_bytes)} allowed per line",
            )
        self.storage[key] = value
        self.storage_bytes = used

    # -- the line's outputs --

    def set_output(self, key: str, value: str, max_outputs: int, max_bytes: int) -> None:
        """`value` is JSON text (kept as a string if it does not parse); the last write
        of a key wins."""
        if key not in self.outputs and len(self.outputs) >= max_outputs:
            raise ControllerError(
                "too_many_outputs",
                f"set-line-output {_shown(key)}: more than {max_outputs} line outputs",
            )
        size = len(key.encode("utf-8", "replace")) + len(value.encode("utf-8", "replace"))
        used = self._output_bytes - self._output_sizes.get(key, 0) + size
        if used > max_bytes:
            raise ControllerError(
                "outputs_too_large",
                f"set-line-output {_shown(key)}: the line's outputs would take {used:,} bytes "
                f"of key and value text, more than the {byte_size(max_bytes)} allowed",
            )
        self._output_bytes = used
        self._output_sizes[key] = size
        try:
            self.outputs[key] = json.loads(value)
        except (ValueError, RecursionError):
            self.outputs[key] = value
