"""Streaming input: with a producer that writes a line now and then (stdin from a pipe),
lines already running keep decoding while the next is awaited, end of input ends the run,
and the first Ctrl-C still stops admission at once (`aici_cli.run.live_input`)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import interruptible
import pytest

from aici_cli.run.live_input import LiveInput, may_block

INTERVAL_S = 1.0  # the producer's pace: a blocking read would cost a running line this long


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


class Producer:
    """`aici-batch run -` fed by hand, its results read as they come, with their times."""

    def __init__(self, tiny_model_dir: Path, *args: str) -> None:
        self.proc = interruptible.popen(
            [*aici_batch(), "run", "-", "--model", str(tiny_model_dir), "--device", "cpu",
             "--dtype", "float32", "--batch-size", "4", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.t0 = time.monotonic()
        self.written: dict[str, float] = {}
        self.results: dict[str, tuple[float, dict[str, Any]]] = {}
        self.err: list[str] = []
        threading.Thread(target=self._read_results, daemon=True).start()
        threading.Thread(target=self._read_errors, daemon=True).start()

    def _read_results(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            result = json.loads(line)
            self.results[result["id"]] = (time.monotonic() - self.t0, result)

    def _read_errors(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def write(self, id_: str, max_tokens: int) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": id_, "prompt": f"Line {id_} of a stream",
                                          "max_tokens": max_tokens, "ignore_eos": True}) + "\n")
        self.proc.stdin.flush()
        self.written[id_] = time.monotonic() - self.t0

    def wait_for(self, id_: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while id_ not in self.results:
            assert self.proc.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, (
                f"no result for {id_} in {timeout} s: the run waits for input instead of "
                f"running the lines it has\n{''.join(self.err)}")
            time.sleep(0.01)


def outside_its_steps_ms(result: dict[str, Any]) -> float:
    """A line's time from admission to result not spent in the passes it took part in
    (forward, masks, sampling, controller): what a blocking read would add to."""
    s = result["stats"]
    return s["total_ms"] - s["forward_ms"] - s["mask_ms"] - s["sample_ms"] - s["controller_ms"]


@pytest.mark.subprocess
@pytest.mark.parametrize("lookahead", ["64", "1"])
def test_a_slow_producer_does_not_hold_up_running_lines(tiny_model_dir: Path,
                                                        lookahead: str) -> None:
    run = Producer(tiny_model_dir, "-q", "--lookahead", lookahead)
    # The first line alone must get its result: reading ahead must not wait for a second.
    run.write("first", 4)
    run.wait_for("first", timeout=120)
    # Then a line now and then, each long enough to be running when the next is awaited.
    ids = [f"s{i}" for i in range(4)]
    for id_ in ids:
        run.write(id_, 48)
        time.sleep(INTERVAL_S)
    assert run.proc.stdin is not None
    run.proc.stdin.close()  # end of input ends the run
    assert run.proc.wait(timeout=120) == 0, "".join(run.err)
    time.sleep(0.1)  # the reader thread takes the last lines

    assert sorted(run.results) == sorted(["first", *ids])
    for id_ in ["first", *ids]:
        _, result = run.results[id_]
        assert result["stats"]["output_tokens"] == (4 if id_ == "first" else 48)
        # Not delayed by the producer: a blocking read would add about INTERVAL_S.
        assert outside_its_steps_ms(result) < 500 * INTERVAL_S, (id_, result["stats"])
    assert run.err == []


@pytest.mark.subprocess
def test_first_sigint_while_waiting_for_input_stops_at_once(tiny_model_dir: Path) -> None:
    run = Producer(tiny_model_dir)
    run.write("a", 4)
    run.wait_for("a", timeout=120)
    time.sleep(0.3)  # the engine is idle, waiting for the next line
    sent = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    code = run.proc.wait(timeout=30)
    waited = time.monotonic() - sent
    err = "".join(run.err)

    assert code == 130, err
    assert waited < 5.0, err
    assert "SIGINT: starting no new lines" in err
    assert "SIGINT: stopped after 1 line" in err
    assert "Traceback" not in err and "Fatal Python error" not in err
    assert sorted(run.results) == ["a"]


@pytest.mark.subprocess
def test_first_sigint_lets_running_lines_finish_while_stdin_stays_open(
    tiny_model_dir: Path
) -> None:
    # No drafts: one pass a token, so the long line (~2 s) is still running at the signal.
    run = Producer(tiny_model_dir, "--batch-size", "2", "--draft-tokens", "0")
    run.write("a", 4)
    run.wait_for("a", timeout=120)
    run.write("long", 1500)  # running when the signal comes
    time.sleep(0.5)
    run.proc.send_signal(signal.SIGINT)
    run.write("late", 4)  # read after the signal: never started
    code = run.proc.wait(timeout=180)
    err = "".join(run.err)

    assert code == 130, err
    assert "finishing the 1 line in flight" in err
    assert sorted(run.results) == ["a", "long"]
    assert run.results["long"][1]["stats"]["output_tokens"] == 1500


# --- LiveInput on its own -------------------------------------------------------------------


def test_items_are_none_while_nothing_is_ready_and_the_consumer_is_busy() -> None:
    gate = threading.Event()

    def slow() -> Any:
        yield 1
        gate.wait(10)
        yield 2

    live: LiveInput[int] = LiveInput(4)
    live.start(slow())
    items = live.items(idle=lambda: False)
    assert next(items) in (1, None)
    seen = [x for x in (next(items) for _ in range(20)) if x is not None]
    assert 2 not in seen  # not read yet: None instead of a wait
    gate.set()
    rest = list(x for x in items if x is not None)
    assert sorted([*seen, *rest]) in ([1, 2], [2]) and rest[-1] == 2


def test_a_failed_read_is_raised_where_the_items_are_taken() -> None:
    def broken() -> Any:
        yield 1
        raise OSError("read failed")

    live: LiveInput[int] = LiveInput(4)
    live.start(broken())
    items = live.items(idle=lambda: True)
    assert next(items) == 1
    with pytest.raises(OSError, match="read failed"):
        next(items)


def test_close_stops_a_reader_waiting_for_room() -> None:
    live: LiveInput[int] = LiveInput(1)
    live.start(iter(range(1000)))
    time.sleep(0.2)
    assert live.reading  # the queue is full
    live.close()
    time.sleep(0.3)
    assert not live.reading


@pytest.mark.subprocess
def test_only_what_can_wait_is_read_on_a_thread(tmp_path: Path) -> None:
    regular = tmp_path / "in.jsonl"
    regular.write_text("{}\n")
    with regular.open("rb") as f:
        assert not may_block(f)
    done = subprocess.run([sys.executable, "-c",
                           "import sys; from aici_cli.run.live_input import may_block; "
                           "print(may_block(sys.stdin.buffer))"],
                          input="", capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "True"  # stdin from a pipe
