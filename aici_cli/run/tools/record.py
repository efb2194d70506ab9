"""A run's tool calls kept and played back: `--tool-record FILE` writes every call and its
answer as a JSON line (`Recorder`, around the servers); `--tool-replay FILE` answers from
such a file, with no server (`ReplayedTools`), so a CI run needs no server and, under
`--deterministic`, repeats the recorded run bit for bit (a replayed answer keeps its
recorded time too).

A call is found by its line, tool and arguments (spacing and key order aside), and a line
that makes one call twice gets the answers in their recorded order. A call that the file
lacks for its line is answered as the same call of another line was, where the file has
one; else it is the line's error (`tool_not_recorded`). Controllers' calls (`aici:tools`)
are recorded and replayed alike, under their line's index; the file also lists the tools
`--allow-tool` names as their servers did (a line with `tool` and no `index`), so that a
replay's `list-tools` gives controllers what the servers gave. Torch-free and mcp-free.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import IO, Any

from aici_cli.core.errors import UsageError
from aici_cli.run.tools.calls import CallOutcome, ServedTool, ToolHost, canonical


def _entry(index: int, name: str, arguments: str, outcome: CallOutcome) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "server": outcome.server, "name": name,
                             "arguments": arguments, "ms": outcome.ms}
    if outcome.error is not None:
        entry["error"] = {"type": outcome.error[0], "message": outcome.error[1]}
    else:
        entry["content"] = outcome.content
        entry["is_error"] = outcome.is_error
    return entry


def _listing(tool: ServedTool) -> dict[str, Any]:
    return {"tool": tool.name, "server": tool.server, "description": tool.description,
            "input_schema": tool.input_schema}


class Recorder:
    """`host`, with every answer written to `path` as it comes (appended on `--resume`,
    so the file keeps the calls of the lines the earlier run finished; a line a kill cut
    short is cut off first), after a line for each tool of `listed` (those controllers
    may call)."""

    def __init__(self, host: ToolHost, path: str, append: bool = False,
                 listed: Sequence[ServedTool] = ()) -> None:
        self.host = host
        self.tools = host.tools
        self._lock = threading.Lock()
        try:
            if append:
                _cut_torn_tail(path)
            self._file: IO[str] = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115
            for tool in listed:
                self._file.write(json.dumps(_listing(tool), ensure_ascii=False) + "\n")
            self._file.flush()
        except OSError as e:
            raise UsageError(f"cannot write --tool-record {path}: {e.strerror}") from None

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        """The host's answer, handed on only once it is written: a line's result is
        written after its answers, so a result in the output means its calls are in the
        record (what `--resume` relies on)."""
        answered: Future[CallOutcome] = Future()

        def write(done: Future[CallOutcome]) -> None:
            if done.cancelled() or done.exception() is not None:  # the run is closing
                answered.cancel()
                return
            outcome = done.result()
            line = json.dumps(_entry(index, name, arguments, outcome), ensure_ascii=False)
            with self._lock:
                if not self._file.closed:
                    self._file.write(line + "\n")
                    self._file.flush()
            answered.set_result(outcome)

        self.host.call(index, name, arguments).add_done_callback(write)
        return answered

    def restarts(self) -> dict[str, int]:
        return self.host.restarts()

    def close(self) -> None:
        self.host.close()
        with self._lock:
            self._file.close()


def _cut_torn_tail(path: str) -> None:
    """Cut `path` back to its last newline (a write a kill cut short); a missing file is
    left missing."""
    try:
        with open(path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    except FileNotFoundError:
        pass


class ReplayedTools:
    """Answers from a `--tool-record` file (see the module docstring)."""

    def __init__(self, path: str) -> None:
        self.tools: dict[str, ServedTool] = {}
        self._by_line: dict[tuple[int, str, str], deque[CallOutcome]] = defaultdict(deque)
        self._by_call: dict[tuple[str, str], CallOutcome] = {}
        number = 0
        try:
            with open(path, encoding="utf-8") as f:
                for text in f:
                    number += 1
                    if not text.strip():
                        continue
                    try:
                        entry = json.loads(text)
                    except ValueError:
                        if not text.endswith("\n"):  # a last write a kill cut short
                            break
                        raise
                    self._add(entry)
        except OSError as e:
            raise UsageError(f"cannot read --tool-replay {path}: {e.strerror}") from None
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--tool-replay {path} line {number} is not a recorded call "
                             f"({type(e).__name__}: {e})") from None

    def _add(self, entry: dict[str, Any]) -> None:
        if "index" not in entry and "tool" in entry:  # a listing: it wins over a call's guess
            name = str(entry["tool"])
            self.tools[name] = ServedTool(str(entry["server"]), name, entry.get("description"),
                                          dict(entry.get("input_schema") or {}))
            return
        error = entry.get("error")
        outcome = CallOutcome(
            str(entry["server"]), entry.get("content"), bool(entry.get("is_error", False)),
            (str(error["type"]), str(error["message"])) if error is not None else None,
            float(entry["ms"]))
        name, key = str(entry["name"]), canonical(str(entry["arguments"]))
        self.tools.setdefault(name, ServedTool(outcome.server, name, None, {}))
        self._by_line[(int(entry["index"]), name, key)].append(outcome)
        self._by_call.setdefault((name, key), outcome)

    def call(self, index: int, name: str, arguments: str) -> Future[CallOutcome]:
        key = canonical(arguments)
        answers = self._by_line.get((index, name, key))
        outcome = answers.popleft() if answers else self._by_call.get((name, key))
        if outcome is None:
            outcome = CallOutcome(self.tools[name].server, error=(
                "tool_not_recorded", f"--tool-replay has no answer to {name}({arguments})"))
        now = time.perf_counter()
        future: Future[CallOutcome] = Future()
        future.set_result(CallOutcome(outcome.server, outcome.content, outcome.is_error,
                                      outcome.error, outcome.ms, now, now))
        return future

    def restarts(self) -> dict[str, int]:
        return {}  # no server runs

    def close(self) -> None:
        pass
