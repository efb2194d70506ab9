"""The host primitives a controller may call, as a `Protocol`, and the active host.

Two implementations satisfy `Host`: the in-wasm one (`_wit.WitHost`, which calls the
component's imports) and `testing.StubHost` (plain CPython). Controller code never picks
one: the session activates its host around every step, and the module-level helpers
(`log`, `set_output`, `set_line_output`, `storage.*`, `tools.*`) go to whichever host is
active.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Host(Protocol):
    """The primitives of the WIT imports `tokenizer`, `host`, `aici:storage/storage` and
    `aici:tools/tools`.

    Every call crosses the wasm boundary in a built component (tens of microseconds, more
    for long lists), so the SDK caches what does not change (eos, vocab size, handles).
    """

    def vocab_size(self) -> int: ...

    def eos_token(self) -> int: ...

    def tokenize(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def tokens_matching(self, pattern: str) -> int:
        """A handle to the host-computed set of tokens whose text fully matches `pattern`.

        Raises `ValueError` when the host rejects the pattern.
        """
        ...

    def log(self, message: str) -> None: ...

    def set_output(self, key: str, value: str) -> None:
        """`value` is JSON text."""
        ...

    def set_line_output(self, key: str, value: str) -> None:
        """The line's own `outputs[key]`, shared by its branches; `value` is JSON text."""
        ...

    def storage_get(self, key: str) -> bytes | None:
        """The value under `key` in the line's storage (shared by its branches)."""
        ...

    def storage_set(self, key: str, value: bytes) -> None: ...

    def storage_append(self, key: str, value: bytes) -> int:
        """Appends to the key's value (empty if unset); returns its new length in bytes."""
        ...

    def list_tools(self) -> list[tuple[str, str, str]]:
        """The tools the run allows this controller: (name, description, input schema as
        JSON text) each (`tools.list_tools` makes them `Tool`s)."""
        ...

    def call_tool(self, name: str, arguments: str) -> tuple[bool, str]:
        """Calls tool `name` with `arguments` (JSON text of an object) and waits:
        (True, its answer) or (False, "TYPE: message")."""
        ...

    # Conveniences: implementations that subclass `Host` explicitly inherit these.

    def token_text(self, token: int) -> str:
        """The text of one token (a `decode` call)."""
        return self.decode([token])

    def set_output_value(self, key: str, value: Any) -> None:
        """Set `outputs[key]` to any JSON-serializable value."""
        self.set_output(key, to_json(value, key))


def to_json(value: Any, key: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            f"set_output({key!r}, ...): the value must be JSON-serializable "
            f"(str, int, float, bool, None, list, dict), got {type(value).__name__}"
        ) from exc


_active: Host | None = None


@contextmanager
def active(host: Host) -> Iterator[Host]:
    """Make `host` the target of `log`/`set_output` for the duration of one step."""
    global _active
    previous, _active = _active, host
    try:
        yield host
    finally:
        _active = previous


def current() -> Host:
    if _active is None:
        raise RuntimeError(
            "no running controller: log(), set_output(), set_line_output(), storage and tools "
            "work only while the host runs the controller (inside its generator or step "
            "method)"
        )
    return _active


def log(message: str) -> None:
    """Append a line to the sequence's `logs` (what `print` does inside a component)."""
    current().log(str(message))


def set_output(key: str, value: Any) -> None:
    """Set `outputs[key]` in the sequence's result line; `value` must be JSON-serializable."""
    current().set_output(key, to_json(value, key))


def set_line_output(key: str, value: Any) -> None:
    """Set the line's own `outputs[key]`: one value for all the line's branches (the last
    write wins), e.g. a vote's winner. `value` must be JSON-serializable."""
    current().set_line_output(key, to_json(value, key))
