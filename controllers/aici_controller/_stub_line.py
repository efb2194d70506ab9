"""What `testing.StubHost` keeps per input line and per sequence when a controller forks.

`StubLine` is the line's storage and outputs, with the host's quotas; `SequenceHost` is
one sequence's view of the stub (its tokenizer, the sequence's own logs and outputs, the
line's storage, the stub's tools), which also journals the storage and tool answers a
sequence got, so that a new branch can be brought to the fork point by replaying them, as
the host does (a replay calls no tool).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ._host import Host
from ._stub_tools import MAX_TOOL_CALLS

if TYPE_CHECKING:
    from .testing import StubHost


class LineFault(BaseException):
    """A host-side fault that ends the whole line (a storage quota, a fork past the cap).

    A `BaseException`, raised from a host call: controller code cannot catch it with
    `except Exception`, as it cannot catch the trap that ends a component's call.
    """

    def __init__(self, type: str, message: str) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message


def parse_output(value: str) -> Any:
    try:
        return json.loads(value)
    except ValueError:
        return value  # the WIT contract: kept as a string


class StubLine:
    """One line's storage and outputs, with the host's default quotas."""

    def __init__(self, storage_keys: int = 256, storage_bytes: int = 1 << 20) -> None:
        self.storage: dict[str, bytes] = {}
        self.outputs: dict[str, Any] = {}
        self.storage_keys = storage_keys
        self.storage_bytes = storage_bytes

    def get(self, key: str) -> bytes | None:
        return self.storage.get(key)

    def put(self, op: str, key: str, value: bytes) -> None:
        if key not in self.storage and len(self.storage) >= self.storage_keys:
            raise LineFault("storage_quota",
                            f"storage {op} {key!r}: more than {self.storage_keys} keys per line")
        used = sum(len(k.encode()) + len(v) for k, v in self.storage.items() if k != key)
        used += len(key.encode()) + len(value)
        if used > self.storage_bytes:
            raise LineFault(
                "storage_quota",
                f"storage {op} {key!r}: the line's storage would hold {used:,} bytes of keys "
                f"and values, more than the {self.storage_bytes:,} bytes allowed per line",
            )
        self.storage[key] = value


class SequenceHost(Host):
    """One sequence's host: the stub's tokenizer, its own logs and outputs, the line's
    storage, the stub's tools. While `replay` is set, storage and tool answers come from
    it and writes (made once already, by the sequence that forked) are dropped."""

    def __init__(self, stub: StubHost, line: StubLine, logs: list[str] | None = None,
                 outputs: dict[str, Any] | None = None) -> None:
        self.stub = stub
        self.line = line
        self.logs: list[str] = logs if logs is not None else []
        self.outputs: dict[str, Any] = outputs if outputs is not None else {}
        self.journal: list[tuple[str, str, Any]] = []  # (op, key, answer) of line calls
        self.replay: Iterator[tuple[str, str, Any]] | None = None
        self.tool_calls = 0  # call_tool calls, those replayed included (as on the host)

    def vocab_size(self) -> int:
        return self.stub.vocab_size()

    def eos_token(self) -> int:
        return self.stub.eos_token()

    def tokenize(self, text: str) -> list[int]:
        return self.stub.tokenize(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.stub.decode(tokens)

    def token_bytes(self, token: int) -> bytes:
        return self.stub.token_bytes(token)

    def tokens_matching(self, pattern: str) -> int:
        return self.stub.tokens_matching(pattern)

    def log(self, message: str) -> None:
        self.logs.append(message)

    def set_output(self, key: str, value: str) -> None:
        self.outputs[key] = parse_output(value)

    def set_line_output(self, key: str, value: str) -> None:
        if self.replay is None:
            self.line.outputs[key] = parse_output(value)

    def storage_get(self, key: str) -> bytes | None:
        if self.replay is not None:
            return self._replayed("get", key)  # type: ignore[no-any-return]
        value = self.line.get(key)
        self.journal.append(("get", key, value))
        return value

    def storage_set(self, key: str, value: bytes) -> None:
        if self.replay is not None:
            self._replayed("set", key)
            return
        self.line.put("set", key, bytes(value))
        self.journal.append(("set", key, None))

    def storage_append(self, key: str, value: bytes) -> int:
        if self.replay is not None:
            return int(self._replayed("append", key))
        new = self.line.storage.get(key, b"") + bytes(value)
        self.line.put("append", key, new)
        self.journal.append(("append", key, len(new)))
        return len(new)

    def list_tools(self) -> list[tuple[str, str, str]]:
        return self.stub.tools.list_tools()

    def call_tool(self, name: str, arguments: str) -> tuple[bool, str]:
        self.tool_calls += 1
        key = f"{name} {arguments}"
        if self.replay is not None:
            return self._replayed("call-tool", key)  # type: ignore[no-any-return]
        if self.tool_calls > MAX_TOOL_CALLS:
            answer = (False, f"tool_quota: more than {MAX_TOOL_CALLS} tool calls per sequence")
        else:
            answer = self.stub.tools.call_tool(name, arguments)
        self.journal.append(("call-tool", key, answer))
        return answer

    def _replayed(self, op: str, key: str) -> Any:
        from .testing import StubHostError

        assert self.replay is not None
        entry = next(self.replay, None)
        if entry is None or entry[:2] != (op, key):
            what = op if op == "call-tool" else f"storage {op}"
            raise StubHostError(
                f"replaying a branch to its fork point, the controller made {what} "
                f"{key!r} where it had made {entry and entry[:2]}: a controller must act "
                "alike given the same inputs (no clock, no randomness)"
            )
        return entry[2]
