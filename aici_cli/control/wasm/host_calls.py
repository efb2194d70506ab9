"""The contract between the host functions a guest imports (`host_functions.py`) and the
guest instance that serves them (`instance.py`): `HostCalls`, what a host function may ask
of the instance whose call is in progress, and `current`, where it finds that instance.

A leaf beside both: `host_functions` knows instances only through this protocol and
`instance` knows nothing of the linker, so neither imports the other.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aici_cli.control.guest_tools import ToolAnswer, ToolInfo
    from aici_cli.control.wasm.services import HostServices
    from aici_cli.core.errors import ControllerError

_U32_MAX = 0xFFFF_FFFF

# The instance whose guest call is in progress on this thread (`.guest`: a HostCalls), or
# None. A guest call and the host functions it makes run on one thread, so this is exact.
current = threading.local()


class HostCalls(Protocol):
    """What the host functions ask of the calling instance.

    Quota, storage and tool methods raise `faults.Fault` when the call must end the guest
    (a quota crossed, a replay that diverged) and ValueError for an error the guest gets
    back as its `err` (`count_pattern`; `call_tool` returns its `err` instead).
    """

    @property
    def services(self) -> HostServices:
        """The tokenizer services of the run (shared by every instance)."""
        ...

    def vocab_size(self) -> int:
        """The vocabulary size, read once when the instance started."""
        ...

    def count_pattern(self, pattern: str) -> None:
        """Counts a `tokens-matching` pattern against the per-sequence caps."""
        ...

    def log(self, message: str) -> None:
        """`host.log`: keeps the line within the log quota."""
        ...

    def set_output(self, key: str, value: str) -> None:
        """`host.set-output`: one of the sequence's outputs, within its quotas."""
        ...

    def set_line_output(self, key: str, value: str) -> None:
        """`host.set-line-output` (0.2.0): an output of the line, shared by its branches."""
        ...

    def storage_get(self, key: str) -> bytes | None:
        """`storage.get` (0.2.0) on the line's storage."""
        ...

    def storage_set(self, key: str, value: bytes) -> None:
        """`storage.set` (0.2.0) on the line's storage."""
        ...

    def storage_append(self, key: str, value: bytes) -> int:
        """`storage.append` (0.2.0); returns the value's new length."""
        ...

    def list_tools(self) -> list[ToolInfo]:
        """`tools.list-tools`: the tools the run allows its controllers."""
        ...

    def call_tool(self, name: str, arguments: str) -> ToolAnswer:
        """`tools.call-tool`: blocks until the answer is in; a failure is its `err`."""
        ...

    def host_failed(self, error: ControllerError) -> None:
        """Records why a host function trapped the guest; the call then reports it."""
        ...

    def host_returned(self, host_s: float, host_cpu_s: float) -> None:
        """A host function took `host_s` seconds, `host_cpu_s` of them this thread's CPU
        time: not charged to the guest's deadline."""
        ...


def to_u32(value: Any, what: str) -> int:
    """`value` (from a host service) as a u32; ValueError when it is out of range."""
    v = int(value)
    if not 0 <= v <= _U32_MAX:
        raise ValueError(f"{what} returned {v}, which is not a u32")
    return v
