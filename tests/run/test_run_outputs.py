"""Every path a run writes is checked before the model loads; a summary that cannot be
written after the run still shows and exits with a status of its own (3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aici_cli.cli.main import main
from aici_cli.core.config import EngineConfig, RunConfig
from aici_cli.core.errors import UsageError
from aici_cli.run.batch import run_batch
from aici_cli.run.out_paths import check_writable, writable_problem


def aici_batch() -> list[str]:
    exe = Path(sys.executable).with_name("aici-batch")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "aici_cli"]


def test_writable_problem_names_what_is_wrong(tmp_path: Path) -> None:
    assert writable_problem(tmp_path / "new.json") is None
    assert writable_problem(tmp_path / "nodir" / "s.json") == (
        f"directory {tmp_path / 'nodir'} does not exist")
    assert writable_problem(tmp_path) == "it is a directory"
    (tmp_path / "file").write_text("")
    assert writable_problem(tmp_path / "file" / "s.json") == (
        f"{tmp_path / 'file'} is not a directory")
    check_writable([("-o", "-"), ("--stats-out", None), ("--trace", tmp_path / "t.json")])
    with pytest.raises(UsageError, match=r"^cannot write --trace .*: it is a directory$"):
        check_writable([("--stats-out", tmp_path / "ok.json"), ("--trace", tmp_path)])


@pytest.mark.subprocess
@pytest.mark.parametrize("option", ["--stats-out", "-o"])
@pytest.mark.parametrize("where", ["nodir/x.json", "."])
def test_an_unwritable_path_exits_two_before_the_model_loads(option: str, where: str,
                                                             tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "a"}\n')
    # A model that does not exist: the path must be refused before the model is looked for.
    done = subprocess.run([*aici_batch(), "run", str(src), "--model", str(tmp_path / "none"),
                           option, where], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    if where == ".":  # Click's own check of the option's value, as for any bad value
        assert "is a directory" in done.stderr.splitlines()[-1]
    else:
        [message] = done.stderr.strip().splitlines()
        assert message == f"Error: cannot write {option} {where}: directory nodir does not exist"
    assert list(tmp_path.iterdir()) == [src]  # nothing written


def test_report_plot_checks_its_path_and_says_write(tmp_path: Path) -> None:
    results = tmp_path / "r.jsonl"
    results.write_text("")
    res = CliRunner().invoke(main, ["report", str(results), "--plot",
                                    str(tmp_path / "nodir" / "x.png")])
    assert res.exit_code == 2
    assert res.stderr.strip() == (f"Error: cannot write --plot {tmp_path / 'nodir' / 'x.png'}:"
                                  f" directory {tmp_path / 'nodir'} does not exist")


@pytest.mark.subprocess
def test_a_summary_that_cannot_be_written_after_the_run_exits_three(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """The directory is there when the run starts and gone when it ends: every result is
    written, the summary is shown, and the status says what failed (not 1: no line did)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"p{i}", "max_tokens": 3}) + "\n"
                           for i in range(3)))
    gone = tmp_path / "gone"
    gone.mkdir()

    def remove_dir(result: dict[str, Any]) -> None:
        if gone.exists():
            gone.rmdir()

    config = RunConfig(input=str(src), output=str(out), model=str(tiny_model_dir),
                       dtype="float32", device="cpu", engine=EngineConfig(batch_size=2),
                       stats_out=str(gone / "s.json"), quiet=True)
    outcome = run_batch(config, on_result=remove_dir)
    assert len(out.read_text().splitlines()) == 3
    assert outcome.summary["lines"] == 3 and outcome.summary["errors"] == 0
    assert outcome.summary_error == (f"cannot write --stats-out {gone / 's.json'}: "
                                     "No such file or directory")
    assert outcome.exit_code == 3
