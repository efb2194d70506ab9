"""What a run says on stderr and in its summary, as a CI log reads them: the start-up
line, a progress line every few seconds off a terminal, one line counting failed lines
(even with -q), and summary figures that mean what they say."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from click.testing import CliRunner
from rich.console import Console

from aici_cli import __version__
from aici_cli.cli.main import main
from aici_cli.formats.jobs import load_schema
from aici_cli.run.ui import ModelLoading, RunDisplay, failure_line, summary_table

FAILING = [
    {"id": "a", "prompt": "Once upon a time", "max_tokens": 3},
    {"id": "b", "promt": "typo"},
    {"id": "c", "prompt": ""},
    {"id": "d", "prompt": "x", "temprature": 1},
]


def jsonl(rows: list[Any]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


@pytest.mark.subprocess
def test_off_a_terminal_progress_comes_as_lines_every_interval(tiny_model_dir: Path,
                                                              tmp_path: Path) -> None:
    """A real process whose stderr is a pipe (as in CI): progress lines while it runs,
    the count of failed lines at the end, and no bar."""
    src = tmp_path / "in.jsonl"
    # Lines long enough (one row, ~1,200 steps) that the run outlasts a few intervals.
    src.write_text(jsonl([{"prompt": f"Line {i}", "max_tokens": 200, "ignore_eos": True}
                          for i in range(6)] + FAILING[1:3]))
    done = subprocess.run([*aici_batch(), "run", str(src), "-o", str(tmp_path / "out.jsonl"),
                           "--model", str(tiny_model_dir), "--batch-size", "1",
                           "--progress-interval", "0.2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    progress = re.findall(r"^aici-batch: (\d+)/8 lines, [\d.]+ tok/s, (\d+) errors?, \d+s$",
                          done.stderr, re.M)
    assert progress, done.stderr
    counts = [int(n) for n, _ in progress]
    assert counts == sorted(counts)  # lines done only grow
    assert done.stderr.rstrip().splitlines()[-1] == (
        "aici-batch: 2 of 8 lines failed (invalid_line 1, empty_prompt 1); "
        "first: line 7: unknown field 'promt' (did you mean 'prompt'?)")
    assert "\r" not in done.stderr  # no terminal bar redrawn in a log


def test_quiet_keeps_only_the_failed_lines_line(tiny_model_dir: Path, tmp_path: Path) -> None:
    stats = tmp_path / "s.json"
    res = CliRunner().invoke(main, ["run", "-", "--model", str(tiny_model_dir), "-q",
                                    "--stats-out", str(stats)], input=jsonl(FAILING))
    assert res.exit_code == 1
    [line] = res.stderr.splitlines()
    assert line.startswith("aici-batch: 3 of 4 lines failed (invalid_line 2, empty_prompt 1); "
                           "first: line ")
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, load_schema("stats"))
    assert summary["error_types"] == {"invalid_line": 2, "empty_prompt": 1}
    assert summary["finish_reasons"]["error"] == 3
    assert summary["first_error"]["type"] in ("invalid_line", "empty_prompt")
    assert summary["version"] == __version__ and summary["interrupted"] is False
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", summary["started_at"])
    assert 0 < summary["load_s"] <= summary["total_s"]
    assert summary["wall_s"] <= summary["total_s"]
    assert summary["batched_forward_passes"] == summary["forward_passes"] > 0
    assert summary["row_passes_per_output_token"] == summary["forward_passes_per_token"]


def test_a_scoring_run_shows_lines_per_second_and_no_none(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    stats = tmp_path / "s.json"
    lines = [{"prompt": f"Q{i}?", "choices": ["yes", "no"], "answer": "yes"} for i in range(3)]
    res = CliRunner().invoke(main, ["run", "-", "--model", str(tiny_model_dir), "--score",
                                    "--stats-out", str(stats)], input=jsonl(lines))
    assert res.exit_code == 0, res.output
    assert "None" not in res.stderr
    assert "lines/s" in res.stderr and "tokens/s" not in res.stderr
    assert "- (no tokens generated)" in res.stderr
    summary = json.loads(stats.read_text())
    assert summary["output_tokens"] == 0 and summary["lines_per_s"] > 0
    assert summary["row_passes_per_output_token"] is None


def test_an_empty_input_warns_instead_of_a_table_of_zeros(tiny_model_dir: Path) -> None:
    res = CliRunner().invoke(main, ["run", "-", "--model", str(tiny_model_dir)], input="\n\n")
    assert res.exit_code == 0
    assert "aici-batch: warning: stdin has no lines to run (it is empty or blank)" in res.stderr
    assert "metric" not in res.stderr


def test_model_loading_is_said_once_it_takes_a_while() -> None:
    out = io.StringIO()
    with ModelLoading(out, quiet=False, what="model x", after_s=0.0):
        import time

        time.sleep(0.1)
    assert re.fullmatch(r"aici-batch: loading model x\.\.\.\naici-batch: model x ready in "
                        r"\d+\.\d s\n", out.getvalue())
    fast = io.StringIO()
    with pytest.raises(KeyError), ModelLoading(fast, quiet=False, what="model y", after_s=5):
        raise KeyError("not found")  # fails at once: its error alone, no loading line
    assert fast.getvalue() == ""
    quiet = io.StringIO()
    with ModelLoading(quiet, quiet=True, what="model z", after_s=0.0):
        pass
    assert quiet.getvalue() == ""


def test_on_a_terminal_a_spinner_turns_from_the_start_and_is_erased() -> None:
    """From the CLI's first moment (before its imports) a terminal shows a spinner; it
    is transient, so an error before the model loads still stands alone."""
    import time

    screen = io.StringIO()
    terminal = Console(file=screen, force_terminal=True, width=80)
    loading = ModelLoading(screen, quiet=False, what="the default model", after_s=60,
                           console=terminal).start()
    time.sleep(0.3)
    loading.finish(ok=False)  # e.g. a resume refused before the model loads
    shown = screen.getvalue()
    assert "aici-batch: loading the default model..." in shown
    assert shown.endswith("\x1b[1A\x1b[2K")  # the spinner's line erased: cursor up, clear
    assert "ready in" not in shown


def test_progress_line_and_failure_line_read_well() -> None:
    display = RunDisplay(io.StringIO(), total=10, interval_s=0)
    for reason in ("stop", "error", "length"):
        display.advance({"finish_reason": reason, "stats": {"output_tokens": 5}})
    assert re.fullmatch(r"aici-batch: 3/10 lines, [\d.]+ tok/s, 1 error, \d+s",
                        display.progress_line())
    assert failure_line({"errors": 0}) is None
    assert failure_line({"errors": 1, "lines": 1, "error_types": {"too_deep": 1},
                         "first_error": {"type": "too_deep", "message": "line 1: deep"}}) == (
        "aici-batch: 1 of 1 line failed (too_deep 1); first: line 1: deep")


def test_the_summary_table_has_no_none() -> None:
    summary = {"lines": 0, "errors": 0, "output_tokens": 0, "ff_tokens": 0,
               "forward_passes": 0, "forward_passes_per_token": None, "wall_s": 0.0,
               "tokens_per_s": 0.0}
    console = Console(file=io.StringIO(), width=100)
    console.print(summary_table(summary))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "None" not in text and "- (no tokens generated)" in text
