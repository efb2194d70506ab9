"""Crash-safe output: the locked result file, `--resume`, and the input-line digests.

Every result line carries `index` (its input line number) and `input_sha256` (a digest of
that input line's bytes). Results are appended one whole line per write, so a run killed at
any moment leaves complete lines plus at most one torn last line. `--resume` reads such a
file back, cuts the torn line off, checks every result against the current input (a changed
input is refused rather than mixed in), and skips the lines that already have a result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

from aici_cli.core.errors import UsageError
from aici_cli.formats.openai_batch import as_result
from aici_cli.run.made_with import FIELD as MADE_WITH
from aici_cli.run.made_with import mismatch

try:  # POSIX only; elsewhere two runs on one output are not kept apart
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

DIGEST_FIELD = "input_sha256"
DIGEST_CHARS = 16  # 64 bits: plenty to notice an edited line, short enough to read


class ResumeError(UsageError):
    """The existing output cannot be resumed against this input; nothing was changed."""


def line_digest(raw: bytes) -> str:
    """Digest of one input line without its line ending, so that appending lines to an
    input whose last line had no newline does not change that line's digest."""
    if raw.endswith(b"\n"):
        raw = raw[:-1]
    if raw.endswith(b"\r"):
        raw = raw[:-1]
    return hashlib.sha256(raw).hexdigest()[:DIGEST_CHARS]


def with_digest(result: Mapping[str, Any], digest: str,
                made_with: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`result` with `input_sha256` placed right after `index`, beside the other keys that
    say which input line a result belongs to, and `made_with` (what made it: see
    `aici_cli.run.made_with`) after it when given."""
    out: dict[str, Any] = {}
    for key, value in result.items():
        out[key] = value
        if key == "index":
            out[DIGEST_FIELD] = digest
            if made_with is not None:
                out[MADE_WITH] = dict(made_with)
    out.setdefault(DIGEST_FIELD, digest)
    if made_with is not None:
        out.setdefault(MADE_WITH, dict(made_with))
    return out


# ------------------------------------------------------------------- reading back


@dataclass(frozen=True)
class Done:
    """A result already in the output file."""

    index: int
    id: str
    digest: str
    error: bool
    out_line: int  # where it sits in the output file (1-based), for messages
    # What made it (`aici_cli.run.made_with`); None from an aici-batch that did not record it.
    made_with: dict[str, Any] | None = None


@dataclass
class OutputScan:
    """What an existing output file holds."""

    done: dict[int, Done] = field(default_factory=dict)  # by input line number
    keep_bytes: int = 0  # length of the complete lines; anything after them is torn
    torn_bytes: int = 0
    torn_line: int = 0  # output line number of the torn line (0: none)

    @property
    def errors(self) -> int:
        return sum(d.error for d in self.done.values())


def _parse_result(text: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def scan_output(data: bytes, name: str) -> OutputScan:
    """Read the result lines in `data`. The last line is torn when it has no newline or
    is not a JSON object (what a killed write or a crashed disk cache leaves); it is
    reported, not kept. Damage anywhere else, a result that names no input line or no
    digest, or two results for one line cannot come from an interrupted run and raise
    `ResumeError`."""
    scan = OutputScan()
    pieces = data.split(b"\n")  # the piece after the last newline is b"" or a torn line
    last = max((n for n, text in enumerate(pieces) if text.strip()), default=-1)
    offset = 0
    for n, text in enumerate(pieces):
        complete = n < len(pieces) - 1
        if text.strip():
            obj = _parse_result(text) if complete else None
            if obj is None:
                if n == last:
                    scan.torn_line = n + 1
                    scan.torn_bytes = len(data) - offset
                    return scan
                raise ResumeError(
                    f"{name} line {n + 1} is not a JSON result line, and it is not the "
                    "last line, so it is not what an interrupted run leaves; fix or remove "
                    "it, or run without --resume to start over"
                )
            _add_done(scan, obj, n + 1, name)
        offset += len(text) + complete
        if complete:
            scan.keep_bytes = offset  # a whitespace-only unterminated tail is dropped too
    return scan


def _add_done(scan: OutputScan, obj: dict[str, Any], number: int, name: str) -> None:
    obj = as_result(obj)  # an OpenAI batch output line keeps these under `aici`
    index, digest = obj.get("index"), obj.get(DIGEST_FIELD)
    if not isinstance(index, int) or isinstance(index, bool) or index < 1:
        raise ResumeError(f"{name} line {number} has no valid 'index', so it cannot be "
                          "matched to an input line; run without --resume to start over")
    if not isinstance(digest, str):
        raise ResumeError(f"{name} line {number} has no '{DIGEST_FIELD}' (written by an "
                          "older aici-batch?), so it cannot be checked against the input; "
                          "run without --resume to start over")
    earlier = scan.done.get(index)
    if earlier is not None:
        raise ResumeError(f"{name} holds two results for input line {index} (lines "
                          f"{earlier.out_line} and {number}); remove one, or run without "
                          "--resume to start over")
    scan.done[index] = Done(
        index=index,
        id=str(obj.get("id", index)),
        digest=digest,
        error=obj.get("finish_reason") == "error",
        out_line=number,
        made_with=obj[MADE_WITH] if isinstance(obj.get(MADE_WITH), dict) else None,
    )


def check_input(done: Mapping[int, Done], lines: Iterable[bytes], input_name: str,
                output_name: str) -> int:
    """Check that every result in `done` belongs to the same line of the input as when it
    was written; returns the number of non-blank input lines."""
    total = 0
    last = 0
    for index, raw in enumerate(lines, start=1):
        last = index
        total += bool(raw.strip())
        prior = done.get(index)
        if prior is not None and line_digest(raw) != prior.digest:
            raise ResumeError(
                f"line {index} of {input_name} changed since its result (id '{prior.id}') "
                f"was written to {output_name}; run without --resume to start over, or "
                "write to another output file"
            )
    beyond = [i for i in done if i > last]
    if beyond:
        raise ResumeError(
            f"{output_name} holds a result for line {min(beyond)}, but {input_name} has "
            f"only {last} lines; run without --resume to start over, or write to another "
            "output file"
        )
    return total


# ------------------------------------------------------------------- the output file


@dataclass
class ResumePlan:
    """The outcome of `OutputFile.plan`: what to skip and what to repair."""

    scan: OutputScan = field(default_factory=OutputScan)
    total: int = 0  # non-blank input lines
    # With --resume-mixed: how earlier results were made otherwise (for the run's notes).
    mixed: list[str] = field(default_factory=list)

    @property
    def done(self) -> dict[int, Done]:
        return self.scan.done

    @property
    def remaining(self) -> int:
        return self.total - len(self.scan.done)

    @property
    def unrecorded(self) -> int:
        """Results that do not say what made them (written by an older aici-batch)."""
        return sum(d.made_with is None for d in self.scan.done.values())

    def made_otherwise(self, record: Mapping[str, Any], keys: set[str] | None = None
                       ) -> str | None:
        """"--max-tokens 64 (result line 3), this run has --max-tokens 128" for the first
        result (in file order) made with other options than `record` (only `keys` of it
        when given); None when every result that says what made it agrees."""
        seen: set[str] = set()
        for done in sorted(self.scan.done.values(), key=lambda d: d.out_line):
            if done.made_with is None:
                continue
            key = json.dumps(done.made_with, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            diff = mismatch(done.made_with, dict(record), keys)
            if diff is not None:
                return f"{diff[0]} (result line {done.out_line}), this run has {diff[1]}"
        return None


class OutputFile:
    """The `-o` file, opened and locked for the whole run.

    Opening neither truncates nor repairs: a run refused before it starts (changed input,
    model not found) leaves an existing file as it was. `prepare` does that once the run
    is certain to go ahead. The lock keeps a second run from writing the same file, which
    would break the one-result-per-line rule.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._stream: IO[str] | None = None
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror}") from None
        try:
            self._lock()
            self.regular = stat.S_ISREG(os.fstat(self.fd).st_mode)
        except BaseException:
            os.close(self.fd)
            raise

    def _lock(self) -> None:
        if fcntl is None:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(f"another run is writing {self.path}") from None
        except OSError:
            pass  # a file system without locks: run unguarded, as without fcntl

    def same_file_as(self, other: BinaryIO) -> bool:
        try:
            return os.path.samestat(os.fstat(self.fd), os.fstat(other.fileno()))
        except (OSError, ValueError):
            return False

    def plan(self, input_path: str) -> ResumePlan:
        """Read the existing results and check them against `input_path`."""
        if not self.regular:
            raise UsageError(f"--resume needs a regular output file; {self.path} is not one")
        with open(self.path, "rb") as f:
            scan = scan_output(f.read(), self.path)
        with open(input_path, "rb") as f:
            total = check_input(scan.done, f, input_path, self.path)
        return ResumePlan(scan, total)

    def prepare(self, plan: ResumePlan | None) -> None:
        """Truncate (a fresh run) or cut the torn tail (a resumed one), then point the
        file at its end so new results are appended."""
        if self.regular:
            os.ftruncate(self.fd, plan.scan.keep_bytes if plan is not None else 0)
            os.lseek(self.fd, 0, os.SEEK_END)

    def stream(self) -> IO[str]:
        """A text stream over the file (the ResultWriter writes through its descriptor);
        it owns the descriptor from here on."""
        if self._stream is None:
            self._stream = open(self.fd, "w", encoding="utf-8", closefd=True)  # noqa: SIM115
        return self._stream

    def close(self) -> None:
        """Close the file, which releases the lock."""
        with contextlib.suppress(OSError):
            if self._stream is not None:
                self._stream.close()
            else:
                os.close(self.fd)


# ---------------------------------------------------------------------- the input


class Interrupted(KeyboardInterrupt):
    """Raised by the signal handler where stopping at once is safe: before any line runs,
    or while blocked reading input. A KeyboardInterrupt, so generic `except Exception`
    clauses in libraries never swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class InputLines:
    """The input's physical lines, for `read_jobs`, with bookkeeping around them.

    Lines that already have a result are handed on as blank lines (so `read_jobs` keeps
    counting line numbers but makes no job of them); every other line's digest is kept
    until its result is written. Reading stops early once `stop` is set.
    """

    def __init__(self, source: Iterable[bytes], skip: Mapping[int, Any] | None = None) -> None:
        self.source = source
        self.skip = skip or {}
        self.digests: dict[int, str] = {}  # lines handed on and not yet written
        self.stop = False  # set by a signal: hand on no more lines
        self.reading = False  # blocked in the source (e.g. stdin): a signal may cut in
        self.exhausted = False  # every line was handed on

    def __iter__(self) -> Iterator[bytes]:
        it = iter(self.source)
        index = 0
        # A signal handler runs on the main thread, so it may cut into a read only there;
        # read on another thread (`live_input`), a blocked read just ends the run later.
        on_main = threading.current_thread() is threading.main_thread()
        while not self.stop:
            try:
                self.reading = on_main
                raw = next(it, None)
                self.reading = False
            except Interrupted:
                self.reading = False
                return
            except BaseException:
                self.reading = False
                raise
            if raw is None:
                self.exhausted = True
                return
            index += 1
            if index in self.skip:
                yield b"\n"
                continue
            if raw.strip():
                self.digests[index] = line_digest(raw)
            yield raw

    @property
    def all_written(self) -> bool:
        """Every line was read and has its result (none waits, read ahead, for a row)."""
        return self.exhausted and not self.digests

    def tag(self, result: dict[str, Any],
            made_with: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """`result` with the digest of its input line, which is forgotten from here on,
        and what made it."""
        digest = self.digests.pop(result.get("index", 0), None)
        return with_digest(result, digest, made_with) if digest is not None else result
