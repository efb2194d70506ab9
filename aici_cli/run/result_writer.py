"""Result lines out: one compact JSON line per result, in the OS before `write` returns.

Every input line ends as exactly one result line (`vocabulary.job.error_result` is the
line for one that could not run).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import time
from collections.abc import Mapping
from typing import IO, Any


def _finite(value: Any) -> Any:
    """Replace NaN/Infinity (not JSON) with null so one odd float cannot break a line."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# U+0085, U+2028 and U+2029 are legal raw inside JSON strings, but str.splitlines() and
# some JSONL readers treat them as line breaks; escaping them keeps one result per line.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _dumps(result: Mapping[str, Any]) -> str:
    """`result` as one compact JSON line (no trailing newline) that no reader splits."""
    try:
        text = json.dumps(result, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        text = json.dumps(
            _finite(result), ensure_ascii=False, separators=(",", ":"), allow_nan=False
        )
    return text.translate(_LINE_BREAKS)


class ResultWriter:
    """Writes result dicts as JSONL, one compact line each, in the OS before `write`
    returns.

    Where the stream has a file descriptor, each line goes to it in one `os.write` of the
    whole line (repeated only after a short write), past Python's buffers: a process
    killed at any moment leaves complete lines and at most one torn last line, which
    `--resume` repairs, and a consumer can tail the output while a long batch runs. Other
    streams (StringIO, captured output) get write + flush.

    Lines in the OS survive a crash of the process but not of the machine. An fsync per
    line costs milliseconds, more than a small result takes to produce, so a regular file
    is fsynced at most every `sync_interval_s` (None: never) and by `sync` at the end: a
    power loss then costs at most that much work, which `--resume` redoes.

    A BrokenPipeError (consumer went away, e.g. `| head`) propagates unchanged so the CLI
    can exit quietly.
    """

    def __init__(self, stream: IO[str], *, sync_interval_s: float | None = None) -> None:
        self.stream = stream
        self.written = 0
        self.errors = 0
        self.fd = self._descriptor(stream)
        self.sync_interval_s = sync_interval_s
        self._syncable = self.fd is not None and stat.S_ISREG(os.fstat(self.fd).st_mode)
        self._synced_at = time.monotonic()
        self._unsynced = False

    @staticmethod
    def _descriptor(stream: IO[str]) -> int | None:
        try:
            fd = stream.fileno()
            stream.flush()  # whatever the stream buffered before goes out first
        except (AttributeError, OSError, ValueError):  # no real file behind it
            return None
        return fd

    def write(self, result: Mapping[str, Any]) -> None:
        line = _dumps(result) + "\n"
        try:
            data = line.encode("utf-8")
        except UnicodeEncodeError:
            # A lone surrogate (from a "\ud800" escape in the input): backslashreplace
            # writes it back as that same JSON escape instead of failing the run.
            data = line.encode("utf-8", "backslashreplace")
            line = data.decode("utf-8")
        if self.fd is None:
            self.stream.write(line)
            self.stream.flush()
        else:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
            self._unsynced = True
            if (self.sync_interval_s is not None
                    and time.monotonic() - self._synced_at >= self.sync_interval_s):
                self.sync()
        self.written += 1
        if result.get("finish_reason") == "error":
            self.errors += 1

    def sync(self) -> None:
        """fsync what was written, where the output is a regular file."""
        fd = self.fd  # never None where `_syncable`
        if fd is None or not (self._syncable and self._unsynced):
            return
        try:
            os.fsync(fd)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTSUP):
                raise
            self._syncable = False  # a file system that cannot sync: the OS has the lines
        self._unsynced = False
        self._synced_at = time.monotonic()
