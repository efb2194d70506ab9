"""Interrupting a real `aici-batch run`: SIGINT and SIGTERM end it cleanly (exit 130/143,
summary printed, every written line whole) so that `--resume` can finish the job; a second
SIGINT stops at once; a reader that goes away ends the run quietly."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import interruptible
import pytest


@pytest.fixture(scope="module")
def model_args(tiny_model_dir: Path) -> list[str]:
    return ["--model", str(tiny_model_dir), "--dtype", "float32", "--device", "cpu",
            "--batch-size", "4"]


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def write_input(path: Path, n: int, max_tokens: Callable[[int], int]) -> None:
    path.write_text("".join(
        json.dumps({"id": f"p{i}", "prompt": f"Line {i} of the batch", "max_tokens":
                    max_tokens(i)}) + "\n" for i in range(n)
    ))


class Run:
    """A background `aici-batch run` whose stderr is collected as it arrives."""

    def __init__(self, args: list[str], out: Path | None = None) -> None:
        self.out = out
        self.proc = interruptible.popen([*aici_batch(), "run", *args],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                        text=True)
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def lines(self) -> int:
        assert self.out is not None
        try:
            return self.out.read_bytes().count(b"\n")
        except FileNotFoundError:
            return 0

    def wait_for(self, condition: Callable[[], bool], timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the run ended early:\n{self.stderr}"
            assert time.monotonic() < deadline, f"timed out:\n{self.stderr}"
            time.sleep(0.005)

    def finish(self, timeout: float = 300.0) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code


def whole_results(path: Path) -> dict[int, dict[str, Any]]:
    """Every line of `path` must be a complete result, each input line at most once."""
    data = path.read_text(encoding="utf-8")
    assert data == "" or data.endswith("\n")
    out: dict[int, dict[str, Any]] = {}
    for line in data.splitlines():
        result = json.loads(line)
        assert result["index"] not in out
        out[result["index"]] = result
    return out


@pytest.mark.subprocess
def test_sigint_then_sigterm_stop_cleanly_and_resume_finishes(model_args: list[str],
                                                             tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    n = 24
    write_input(src, n, lambda i: 8 + i % 4 * 4)
    args = [str(src), "-o", str(out), *model_args, "--resume"]

    for sig, code, name in [(signal.SIGINT, 130, "SIGINT"), (signal.SIGTERM, 143, "SIGTERM")]:
        run = Run(args, out)
        start = run.lines()
        run.wait_for(lambda run=run, start=start: run.lines() >= start + 2)
        run.proc.send_signal(sig)
        assert run.finish() == code, run.stderr
        err = run.stderr
        assert f"{name}: starting no new lines" in err
        assert "tokens/s" in err  # the summary table
        assert f"{name}: stopped with" in err and "--resume" in err
        assert "Traceback" not in err
        done = whole_results(out)
        assert start + 2 <= len(done) < n

    final = Run(args, out)
    assert final.finish() == 0, final.stderr
    assert f"resuming: {len(done)} of {n} lines" in final.stderr
    assert sorted(whole_results(out)) == list(range(1, n + 1))


@pytest.mark.subprocess
def test_second_sigint_stops_at_once(model_args: list[str], tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    # Two short lines first, then lines far too long to finish before the second signal.
    write_input(src, 8, lambda i: 2 if i < 2 else 1500)
    run = Run([str(src), "-o", str(out), *model_args], out)
    run.wait_for(lambda: run.lines() >= 1)
    run.proc.send_signal(signal.SIGINT)
    run.wait_for(lambda: "SIGINT: starting no new lines" in run.stderr)
    run.proc.send_signal(signal.SIGINT)
    assert run.finish(timeout=60) == 130, run.stderr
    err = run.stderr
    assert "SIGINT again, stopping now" in err
    assert "tokens/s" not in err  # it did not wait for the rows in flight
    assert "Traceback" not in err
    assert 1 <= len(whole_results(out)) <= 2


@pytest.mark.subprocess
def test_a_reader_going_away_ends_the_run_quietly(model_args: list[str],
                                                  tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    write_input(src, 30, lambda i: 8)
    command = " ".join(shlex.quote(a) for a in [*aici_batch(), "run", str(src), *model_args])
    shell = f'{command} | head -1; echo "status=${{PIPESTATUS[0]}}" >&2'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300)
    assert json.loads(done.stdout)["index"] >= 1  # exactly one whole line
    assert "status=0" in done.stderr
    for noise in ("Traceback", "BrokenPipeError", "Exception ignored"):
        assert noise not in done.stderr, done.stderr
