"""The supervised run tells its engine process that the input ended as soon as it has
nothing more to send, lines still in flight: the engine's compiled step then sizes its
graph to the busy rows (a one-line input computes one row, not the batch size's).

A fake engine process stands in for the child (no model): it answers each line only
after a few polls, so the order of what the run sends is observable."""

from __future__ import annotations

from typing import Any

import pytest
from factories import job

from aici_cli.core.config import EngineConfig, RunConfig
from aici_cli.core.job import Job
from aici_cli.run.backends import supervised
from aici_cli.run.backends.child_messages import (
    Drained,
    EndOfInput,
    Figures,
    Finished,
    Started,
)


class FakeProcess:
    """Records what the run sends; answers each line `delay` polls after it came, and
    `Drained` once the input ended and no line is left. `die_after`: polls until it dies
    (its lines unanswered)."""

    log: list[tuple[str, Any]] = []

    def __init__(self, config: RunConfig, life: int, delay: int = 3,
                 die_after: int | None = None) -> None:
        self.info = {"model_name": "fake", "quantize": "none", "meta": {}, "threads": 1}
        self.gone = False
        self.life = life
        self.delay = delay
        self.die_after = die_after
        self.polls = 0
        self.held: list[tuple[int, Job]] = []  # (poll it came at, line)
        self.ended = False
        self.started: set[int] = set()

    def wait_ready(self, replay: Any, go_on: Any) -> bool:
        return True

    def send(self, message: object) -> None:
        if isinstance(message, list):
            self.held += [(self.polls, j) for j in message]
            FakeProcess.log += [("line", (self.life, j.index)) for j in message]
        elif isinstance(message, EndOfInput):
            self.ended = True
            FakeProcess.log.append(("end", (self.life, [j.index for _, j in self.held])))

    def receive(self, timeout: float) -> list[object]:
        self.polls += 1
        if self.die_after is not None and self.polls >= self.die_after and self.held:
            self.gone = True
            return []
        out: list[object] = [Started(j.index) for _, j in self.held
                             if j.index not in self.started]
        self.started |= {j.index for _, j in self.held}
        done = [j for at, j in self.held if self.polls - at >= self.delay]
        self.held = [(at, j) for at, j in self.held if self.polls - at < self.delay]
        for j in done:
            FakeProcess.log.append(("finished", (self.life, j.index)))
            out.append(Finished({"index": j.index, "text": "x"}, Figures()))
        if self.ended and not self.held:
            out.append(Drained(Figures()))
        return out

    def ending(self) -> str:
        return "killed by a signal"

    def stop(self) -> None:
        self.gone = True


@pytest.fixture(autouse=True)
def fresh_log() -> None:
    FakeProcess.log = []


def _run(monkeypatch: pytest.MonkeyPatch, n: int, make: Any = FakeProcess
         ) -> list[dict[str, Any]]:
    monkeypatch.setattr(supervised, "EngineProcess", make)
    engine = supervised.SupervisedEngine(RunConfig(input="-", engine=EngineConfig(batch_size=4)))
    results: list[dict[str, Any]] = []
    engine.run(iter([job(i + 1) for i in range(n)]), results.append, lambda: True,
               lambda note: None)
    return results


@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_end_of_input_goes_with_the_lines_still_in_flight(
        monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    results = _run(monkeypatch, n)
    assert sorted(r["index"] for r in results) == list(range(1, n + 1))
    kinds = [kind for kind, _ in FakeProcess.log]
    assert kinds.count("end") == 1
    end = kinds.index("end")
    # Every line was sent before the end, and none had its result yet.
    assert kinds[:end] == ["line"] * n
    assert FakeProcess.log[end][1] == (1, list(range(1, n + 1)))


def test_more_lines_than_the_engine_holds_end_only_after_the_last_is_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    n = 12  # batch 4 + lookahead: not all fit in flight at once
    results = _run(monkeypatch, n)
    assert sorted(r["index"] for r in results) == list(range(1, n + 1))
    kinds = [kind for kind, _ in FakeProcess.log]
    end = kinds.index("end")
    assert kinds.count("line") == n and "line" not in kinds[end:]
    assert "finished" in kinds[end:]  # lines were still in flight when it went


def test_after_a_death_the_new_life_gets_its_lines_again_then_the_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def make(config: RunConfig, life: int) -> FakeProcess:
        return FakeProcess(config, life, die_after=2 if life == 1 else None)

    results = _run(monkeypatch, 2, make)
    assert sorted(r["index"] for r in results) == [1, 2]
    second = [(kind, what) for kind, what in FakeProcess.log if what[0] == 2]
    assert [kind for kind, _ in second][:3] == ["line", "line", "end"]
