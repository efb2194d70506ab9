"""`aici_cli.report.summarize`: figures derived from hand-built result lines, checked exactly.

The fixture results are a small batch whose per-sequence stats equal the sums of their
per-step records, so both step sources can be checked against numbers worked out by
hand (nearest-rank percentiles, as in `stats.percentile`).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from rich.console import Console

from aici_cli.core.line_stats import StepTimes
from aici_cli.formats.jobs import load_schema
from aici_cli.report.plot import plot
from aici_cli.report.summarize import (
    NO_RUN_SUMMARY_NOTE,
    ReportError,
    merge_run_summary,
    report,
    report_table,
    summarize_results,
)
from aici_cli.run.tally import RunTally

RESULT_VALIDATOR = Draft202012Validator(load_schema("result-line"))
STATS_VALIDATOR = Draft202012Validator(load_schema("stats"))

ZERO = {"prompt_tokens": 0, "output_tokens": 0, "forward_passes": 0, "ff_tokens": 0,
        "ttft_ms": 0.0, "total_ms": 0.0, "forward_ms": 0.0, "mask_ms": 0.0,
        "controller_ms": 0.0, "sample_ms": 0.0}


def _steps(forward: list[float], mask: list[float], ctrl: list[float],
           sample: list[float]) -> list[dict[str, Any]]:
    return [
        {"step": i, "kind": "prefill" if i == 0 else "decode", "sampled": 1, "forced": 0,
         "forward_ms": f, "mask_ms": m, "controller_ms": c, "sample_ms": s}
        for i, (f, m, c, s) in enumerate(zip(forward, mask, ctrl, sample))
    ]


def _result(index: int, reason: str, steps: list[dict[str, Any]] | None = None,
            prompt: int = 0, out: int = 0, ff: int = 0, error: str | None = None,
            **extra: Any) -> dict[str, Any]:
    """A result line whose stats are the sums of its step records (as the engine makes)."""
    stats = dict(ZERO, prompt_tokens=prompt, output_tokens=out, ff_tokens=ff)
    if steps:
        stats["forward_passes"] = len(steps)
        for f in ("forward_ms", "mask_ms", "controller_ms", "sample_ms"):
            stats[f] = sum(s[f] for s in steps)
        stats["total_ms"] = 999.0  # overlapping wall time: must not feed any figure
        stats["ttft_ms"] = 50.0
    line: dict[str, Any] = {"id": f"r{index}", "index": index, "text": "x",
                            "finish_reason": reason, "stats": stats, **extra}
    if error is not None:
        line["error"] = {"type": error, "message": f"line {index}: {error}"}
    if steps is not None:
        line["steps"] = steps
    RESULT_VALIDATOR.validate(line)
    return line


def batch(with_steps: bool = True) -> list[dict[str, Any]]:
    """Six results: 2 schema lines that ran (1 valid), 3 errors (timeout x2,
    controller_error, the latter mid-run with valid=false: a schema line that did not
    run to the end, counted in compliance over all schema lines only), and 11 row passes
    for 12 output tokens (2 fast-forwarded)."""
    a = _steps([20.0, 5.0, 5.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0], [0.5, 0.5, 0.5])
    b = _steps([25.0, 5.0, 5.0, 5.0, 5.0], [2.0, 0.5, 0.5, 0.5, 0.5], [1.0] * 5, [0.5] * 5)
    d = _steps([30.0, 6.0], [0.0, 0.0], [4.0, 8.0], [1.0, 1.0])
    e = _steps([10.0], [0.0], [0.0], [0.25])
    rows = [
        _result(1, "stop", a, prompt=10, out=5, ff=2, json={"k": 1}, valid=True),
        _result(2, "length", b, prompt=8, out=5, json={"k": "x"}, valid=False),
        _result(3, "error", error="timeout"),
        _result(4, "error", d, prompt=6, out=2, error="controller_error", valid=False),
        _result(5, "stop", e, prompt=5, out=0),
        _result(6, "error", error="timeout"),
    ]
    if not with_steps:
        for r in rows:
            r.pop("steps", None)
            RESULT_VALIDATOR.validate(r)
    return rows


def jsonl(rows: list[dict[str, Any]]) -> list[str]:
    return [json.dumps(r) + "\n" for r in rows]


COUNTS = {
    "lines": 6, "errors": 3, "prompt_tokens": 29, "output_tokens": 12, "ff_tokens": 2,
    "row_forward_passes": 11, "forward_passes_per_token": 0.9167, "schema_lines": 2,
    "valid": 1, "schema_errors": 1, "compliance": 0.3333, "compliance_ran": 0.5,
    "error_types": {"timeout": 2, "controller_error": 1},
    "finish_reasons": {"error": 3, "stop": 2, "length": 1},
    "forward_passes": None, "wall_s": None, "tokens_per_s": None,
    "model": None, "device": None, "dtype": None, "batch_size": None,
}

# 11 sequence-step records; e.g. forward sorted [5 x6, 6, 10, 20, 25, 30]: p50 = 6th.
STEPS_FROM_RECORDS = {
    "forward_ms": {"p50": 5.0, "p99": 30.0, "mean": 11.0},
    "mask_ms": {"p50": 0.5, "p99": 2.0, "mean": 0.636},
    "controller_ms": {"p50": 1.0, "p99": 8.0, "mean": 2.091},
    "sample_ms": {"p50": 0.5, "p99": 1.0, "mean": 0.568},
}
# 4 sequences that ran: per-pass averages, e.g. forward [10, 9, 18, 10]; the mean is
# weighted by passes, so it equals the records' mean.
STEPS_PER_SEQUENCE = {
    "forward_ms": {"p50": 10.0, "p99": 18.0, "mean": 11.0},
    "mask_ms": {"p50": 0.0, "p99": 1.0, "mean": 0.636},
    "controller_ms": {"p50": 1.0, "p99": 6.0, "mean": 2.091},
    "sample_ms": {"p50": 0.5, "p99": 1.0, "mean": 0.568},
}


def test_summary_from_step_records() -> None:
    lines = jsonl(batch())
    lines.insert(2, "\n")  # blank lines are skipped
    summary = summarize_results(lines)
    for key, value in COUNTS.items():
        assert summary[key] == value, key
    assert list(summary["finish_reasons"]) == ["error", "stop", "length"]  # by count
    assert summary["steps"] == STEPS_FROM_RECORDS
    assert summary["step_source"] == "steps"
    assert summary["notes"] == [NO_RUN_SUMMARY_NOTE]


def test_summary_from_per_sequence_stats() -> None:
    summary = summarize_results(jsonl(batch(with_steps=False)))
    for key, value in COUNTS.items():
        assert summary[key] == value, key
    assert summary["steps"] == STEPS_PER_SEQUENCE
    assert summary["step_source"] == "per-sequence"


def test_mixed_step_records_fall_back_to_per_sequence() -> None:
    rows = batch()
    del rows[1]["steps"]  # one sequence that ran has no records
    summary = summarize_results(jsonl(rows))
    assert summary["step_source"] == "per-sequence"
    assert summary["steps"] == STEPS_PER_SEQUENCE
    assert any("1 of 4 sequences" in n for n in summary["notes"])


def test_no_passes_and_no_output() -> None:
    summary = summarize_results(jsonl([_result(1, "error", error="timeout")]))
    assert summary["lines"] == 1 and summary["errors"] == 1
    assert summary["forward_passes_per_token"] is None
    assert summary["compliance"] is None
    assert summary["steps"] == {} and summary["step_source"] is None
    assert summarize_results([])["lines"] == 0


@pytest.mark.parametrize(("lines", "message"), [
    (["{\"id\": \"a\",\n"], "line 1: not JSON"),
    ([json.dumps(_result(1, "stop")) + "\n", "\n", "[1, 2]\n"],
     "line 3: expected a result object, got list"),
    ([json.dumps({"id": "a", "index": 1, "text": "", "finish_reason": "stop"})],
     "line 1: not a result line: (top level): 'stats' is a required property"),
    ([json.dumps(dict(_result(1, "stop"), finish_reason="done"))],
     "line 1: not a result line: finish_reason: 'done' is not one of"),
])
def test_malformed_line_names_it(lines: list[str], message: str) -> None:
    with pytest.raises(ReportError) as exc:
        summarize_results(lines)
    assert str(exc.value).startswith(message)


def run_summary(lines: int = 6, output_tokens: int = 12) -> dict[str, Any]:
    """A real --stats-out summary, built the way the runner builds it."""
    tally = RunTally(lines=lines, output_tokens=output_tokens, row_forward_passes=11)
    steps = [StepTimes("prefill", 4, 29, forward_ms=40.0, mask_ms=2.0, controller_ms=5.0,
                       sample_ms=1.0, step_ms=50.0),
             StepTimes("decode", 2, 2, forward_ms=8.0, mask_ms=1.0, controller_ms=2.0,
                       sample_ms=1.0, step_ms=14.0)]
    meta = {"model": "tiny-llama", "device": "cpu", "dtype": "float32", "batch_size": 4}
    summary = tally.run_summary(steps, wall_s=2.0, meta=meta)
    STATS_VALIDATOR.validate(summary)
    return summary


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_report_takes_run_level_figures_from_stats_file(tmp_path: Path) -> None:
    results = write(tmp_path, "out.jsonl", "".join(jsonl(batch())))
    stats = run_summary()
    stats_path = write(tmp_path, "out.stats.json", json.dumps(stats))
    summary = report(results, stats_path)
    assert summary["wall_s"] == 2.0
    assert summary["tokens_per_s"] == 6.0  # 12 tokens / 2 s, the run's own figure
    assert summary["forward_passes"] == 2
    assert (summary["model"], summary["device"], summary["dtype"], summary["batch_size"]) == (
        "tiny-llama", "cpu", "float32", 4)
    assert summary["steps"] == stats["steps"]
    assert summary["steps"]["step_ms"] == {"p50": 14.0, "p99": 50.0, "mean": 32.0}
    assert summary["steps"]["overhead_ms"]["mean"] == 8.0
    assert summary["step_source"] == "stats"
    assert summary["notes"] == []
    for key in ("lines", "errors", "valid", "schema_errors", "compliance", "compliance_ran",
                "error_types", "ff_tokens"):
        assert summary[key] == COUNTS[key], key  # counts stay derived from the results
    # Without the stats file the same results give no run-level figures.
    alone = report(results)
    assert alone["tokens_per_s"] is None and alone["step_source"] == "steps"


def test_stats_file_from_another_run_is_noted() -> None:
    summary = merge_run_summary(summarize_results(jsonl(batch())), run_summary(lines=7))
    assert summary["notes"] == [
        "the stats file counts lines 7, the results 6: run-level figures may be from "
        "another run"
    ]


def test_report_errors(tmp_path: Path) -> None:
    results = write(tmp_path, "out.jsonl", "".join(jsonl(batch())))
    with pytest.raises(ReportError, match="cannot read the results"):
        report(tmp_path / "missing.jsonl")
    with pytest.raises(ReportError, match="not a run summary"):
        report(results, write(tmp_path, "bad.json", json.dumps({"lines": 6})))
    with pytest.raises(ReportError, match="not JSON"):
        report(results, write(tmp_path, "bad2.json", "{"))


def test_report_reads_stdin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(jsonl(batch()))))
    assert report("-")["output_tokens"] == 12


def render(summary: dict[str, Any]) -> str:
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    console.print(report_table(summary))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_table_from_results_alone() -> None:
    out = render(summarize_results(jsonl(batch())))
    assert "aici-batch report" in out
    assert "schema outputs valid, of all schema lines" in out and "1/3 (33.3%)" in out
    assert "schema outputs valid, of those that ran" in out and "1/2 (50.0%)" in out
    assert "0.9167" in out
    assert "error timeout" in out and "error controller_error" in out
    assert "error 3, stop 2, length 1" in out
    assert "n/a (needs --stats-out)" in out  # tokens/s, wall time, batched passes
    assert "step forward_ms p50 / p99 / mean" in out
    assert "5.00 / 30.00 / 11.00" in out
    assert "per-step records" in out


def test_table_with_run_summary_and_empty() -> None:
    out = render(merge_run_summary(summarize_results(jsonl(batch())), run_summary()))
    assert "tokens/s" in out and "6.0" in out
    assert "2.00 s" in out and "tiny-llama" in out
    assert "step step_ms p50 / p99 / mean" in out and "14.00 / 50.00 / 32.00" in out
    assert "n/a" not in out
    empty = render(summarize_results([]))
    assert "- (no schema lines)" in empty and "- (no forward passes)" in empty


def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    results = write(tmp_path, "out.jsonl", "".join(jsonl(batch())))
    stats_path = write(tmp_path, "out.stats.json", json.dumps(run_summary()))
    for name, stats in (("alone.png", None), ("with-stats.png", stats_path)):
        png = tmp_path / name
        report(results, stats, plot_to=png)
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    # No timings at all still draws (panels say there is no data).
    empty = plot(summarize_results([]), tmp_path / "empty.png")
    assert empty.read_bytes().startswith(b"\x89PNG")


def test_plot_counts_are_whole_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The histogram's count axis has whole ticks, even for a few values (where matplotlib
    would put ticks at 0.25, 1.75 ...)."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    drawn: list[Any] = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (drawn.append(fig),
                                                                 save(fig, *a, **k)))
    plot(summarize_results([]), tmp_path / "few.png", step_totals=[1.0, 1.5, 2.0, 2.2, 3.0])
    [figure] = drawn
    ticks = figure.axes[1].get_yticks()
    assert len(ticks) >= 2 and all(float(t).is_integer() for t in ticks), ticks


def test_plot_without_matplotlib(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import now fails
    results = write(tmp_path, "out.jsonl", "".join(jsonl(batch())))
    with pytest.raises(ReportError, match=r"--plot needs matplotlib: pip install matplotlib"):
        report(results, plot_to=tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.none(), st.floats(0.0, 1.0)), max_size=40))
def test_the_report_names_the_lines_the_constraint_bent_most(masses: list[float | None]
                                                             ) -> None:
    """`bent_most`: the ten lowest `allowed_mass_min`, lowest first (ties in file order),
    of the lines that carry one; the others never appear."""
    lines = []
    for i, mass in enumerate(masses):
        line = _result(i + 1, "stop")
        if mass is not None:
            line["stats"].update(allowed_mass_min=mass, allowed_mass_mean=min(1.0, mass + 0.1),
                                 allowed_mass_steps=3)
        lines.append(line)
    bent = summarize_results(jsonl(lines))["bent_most"]
    weighed = sorted((m, i + 1) for i, m in enumerate(masses) if m is not None)[:10]
    assert [(b["allowed_mass_min"], b["index"]) for b in bent] == weighed
    assert all(b["id"] == f"r{b['index']}" for b in bent)
    text = io.StringIO()
    Console(file=text, width=200).print(report_table(summarize_results(jsonl(lines))))
    assert ("bent most by the constraint" in text.getvalue()) == bool(weighed)
