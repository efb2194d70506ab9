"""`--ordered`: results in input order through a bounded reorder buffer, with --resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from aici_cli.cli.main import main
from aici_cli.core.job import BadLine
from aici_cli.run.ordered import InputOrder


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(min_value=1, max_value=30), st.integers(min_value=1, max_value=8),
       st.integers(min_value=1, max_value=6))
def test_any_finishing_order_is_written_in_input_order(data: st.DataObject, n: int, limit: int,
                                                       rows: int) -> None:
    """A run as the engine drives it: lines start in input order while a row is free and
    the buffer is not `full`, and finish in any order. Results come out in input order,
    no more than `limit` wait, and a full buffer never stalls the run (the earliest
    unfinished line always holds a row). The lines already running when it fills still
    finish into it, so it holds at most `limit` + rows - 1."""
    written: list[int] = []
    order: InputOrder[int] = InputOrder(written.append, limit=limit)
    waiting = order.track(iter([BadLine(i, str(i), "t", "m") for i in range(1, n + 1)]))
    running: list[int] = []
    exhausted = False
    while True:
        while not exhausted and len(running) < rows and not order.full:
            item = next(waiting, None)
            if item is None:
                exhausted = True
            else:
                running.append(item.index)
        if not running:
            break
        finished = running.pop(data.draw(st.integers(0, len(running) - 1)))
        order.put(finished, finished)
        assert order.held <= limit + rows - 1
    assert exhausted, "the buffer stalled the run"
    assert written == list(range(1, n + 1))


def test_flush_writes_what_waits_behind_a_line_that_never_ran() -> None:
    written: list[str] = []
    order: InputOrder[str] = InputOrder(written.append)
    list(order.track(iter([BadLine(i, str(i), "t", "m") for i in (1, 2, 4, 5)])))
    order.put(5, "five")
    order.put(1, "one")
    order.put(4, "four")
    assert written == ["one"]  # 2 never finished (an interrupt): 4 and 5 wait
    order.flush()
    assert written == ["one", "four", "five"]
    order.put(9, "unknown")  # not read through track: nothing to wait for
    assert written[-1] == "unknown"


def lines(n: int) -> list[dict[str, Any]]:
    """Lines of very different lengths, so that they finish out of order."""
    return [{"id": f"l{i}", "prompt": f"Line {i} says", "max_tokens": 24 if i % 3 == 0 else 2}
            for i in range(1, n + 1)]


def run(tmp_path: Path, model: Path, src: Path, out: Path, *extra: str) -> int:
    res = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--model", str(model),
                                    "--dtype", "float32", "--batch-size", "4", "-q", *extra])
    assert res.exit_code == 0, res.output
    return res.exit_code


def indexes(out: Path) -> list[int]:
    return [json.loads(line)["index"] for line in out.read_text().splitlines()]


@pytest.mark.heavy
def test_ordered_results_follow_the_input_and_resume_appends_in_order(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines(12)))
    unordered, ordered = tmp_path / "unordered.jsonl", tmp_path / "ordered.jsonl"
    run(tmp_path, tiny_model_dir, src, unordered)
    assert indexes(unordered) != list(range(1, 13))  # short lines overtake long ones
    run(tmp_path, tiny_model_dir, src, ordered, "--ordered", "--stats-out",
        str(tmp_path / "s.json"))
    assert indexes(ordered) == list(range(1, 13))
    assert json.loads((tmp_path / "s.json").read_text())["ordered"] is True
    # Same results, only the order differs.
    by_index = {json.loads(x)["index"]: json.loads(x)["text"]
                for x in unordered.read_text().splitlines()}
    assert [json.loads(x)["text"] for x in ordered.read_text().splitlines()] == [
        by_index[i] for i in range(1, 13)]

    # A run cut short after 5 results: --resume --ordered appends the other 7, in order.
    ordered.write_text("".join(ordered.read_text().splitlines(keepends=True)[:5]))
    run(tmp_path, tiny_model_dir, src, ordered, "--ordered", "--resume")
    assert indexes(ordered) == list(range(1, 13))
