"""`aici-batch report --markdown FILE`: the report as Markdown for a CI job's summary page
(GitHub's `$GITHUB_STEP_SUMMARY`, a merge request note): the figures, the gates, and the
comparison with the baseline, the changed answers folded away under a `<details>`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aici_cli.report.baseline import Comparison
from aici_cli.report.gate import GateResult

CHANGES_SHOWN = 50  # a summary page is read by people: the JSON output has them all


def _cell(value: Any, limit: int = 80) -> str:
    """Table cell text: one line, pipes escaped, long answers cut."""
    text = str(value).replace("\r", " ").replace("\n", " ")
    if len(text) > limit:
        text = text[:limit] + "…"
    return text.replace("|", "\\|") or " "


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / whole:.1%})" if whole else "-"


def figures_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [("lines", str(summary["lines"])),
            ("errors", _share(summary["errors"], summary["lines"]))]
    if summary.get("answered"):
        rows.append(("accuracy", f"{summary['accuracy']:.2%} of {summary['answered']} lines"))
    schema_all = summary.get("schema_lines", 0) + summary.get("schema_errors", 0)
    if schema_all:
        rows.append(("compliance (all schema lines)", _share(summary["valid"], schema_all)))
        rows.append(("compliance (lines that ran)",
                     _share(summary["valid"], summary["schema_lines"])))
    if summary.get("tokens_per_s") is not None:
        rows.append(("tokens/s", f"{summary['tokens_per_s']:.1f}"))
    if summary.get("wall_s") is not None:
        rows.append(("wall time", f"{summary['wall_s']:.1f} s"))
    if summary.get("model"):
        rows.append(("model", str(summary["model"])))
    return rows


def comparison_lines(c: Comparison) -> list[str]:
    """The comparison in a few sentences (shared by the console and Markdown)."""
    lines = [f"{c.matched} lines matched {c.baseline} by id and input digest; "
             f"{c.only_now} only here, {c.only_before} only in the baseline, "
             f"{c.input_changed} with a changed input (not compared)"]
    if c.paired:
        assert c.accuracy_before is not None and c.accuracy_now is not None
        low, high = c.interval or (0.0, 0.0)
        lines.append(f"accuracy {c.accuracy_before:.4f} -> {c.accuracy_now:.4f} on "
                     f"{c.paired} paired lines: delta {c.delta:+.4f}, 95% CI "
                     f"[{low:+.4f}, {high:+.4f}] (paired bootstrap), McNemar p = "
                     f"{c.p_value:.4g}")
    else:
        lines.append("no matched line has an expected answer in both runs: no accuracy "
                     "comparison")
    lines.append(f"{len(c.changes)} answers changed: {c.right_to_wrong} right->wrong, "
                 f"{c.wrong_to_right} wrong->right; {c.newly_failing} lines newly failing "
                 "(error or invalid)")
    return lines


def markdown(title: str, summary: dict[str, Any], gates: Sequence[GateResult],
             comparison: Comparison | None, regression: str | None = None) -> str:
    out = [f"## aici-batch report: {_cell(title)}", "", "| metric | value |",
           "| --- | ---: |"]
    out += [f"| {name} | {_cell(value)} |" for name, value in figures_rows(summary)]
    if gates:
        out += ["", "### Gates", "", "| gate | value | result |", "| --- | ---: | --- |"]
        for g in gates:
            value = "n/a" if g.value is None else f"{g.value:.4g}"
            out.append(f"| `{g.gate.text}` | {value} | "
                       f"{'✅ pass' if g.passed else '❌ fail'} |")
    if comparison is not None:
        out += ["", f"### Against the baseline `{_cell(comparison.baseline)}`", ""]
        out += [f"- {line}" for line in comparison_lines(comparison)]
        if regression is not None:
            out.append(f"- ❌ {regression}")
        if comparison.changes:
            shown = comparison.changes[:CHANGES_SHOWN]
            out += ["", f"<details><summary>Changed answers ({len(comparison.changes)})"
                        "</summary>", "", "| line | change | before | now | expected |",
                    "| --- | --- | --- | --- | --- |"]
            out += [f"| {_cell(c.now.name)} | {c.way} | {_cell(c.before.text)} | "
                    f"{_cell(c.now.text)} | {_cell(c.now.answer or '')} |" for c in shown]
            if len(comparison.changes) > len(shown):
                out.append(f"\n({len(comparison.changes) - len(shown)} more in `--json`)")
            out += ["", "</details>"]
    return "\n".join(out) + "\n"
