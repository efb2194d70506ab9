"""`aici-batch report --html`: the page's data, read back out of the written file (as the
browser unpacks it), against `--json`, the Markdown, the JUnit file and the run's own
files (tests/support/report_pages.py's run). The page in a browser: test_page_browser.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from junitparser import JUnitXml
from report_pages import PageRun, page_run_in, results, stats, write_jsonl

from aici_cli.cli.main import main
from aici_cli.report.markdown import figures_rows
from aici_cli.report.page.payload import COMPRESS_FROM, decode, encode
from aici_cli.report.page.rows import COLUMNS
from aici_cli.report.page.step_plot import step_svg
from aici_cli.report.page.timeline_plot import BARS, timeline_svg
from aici_cli.report.page.write import render
from aici_cli.report.timeline import Bar, Step


@pytest.fixture
def page_run(tmp_path: Path) -> PageRun:
    return page_run_in(tmp_path)


def report(*args: str) -> Any:
    return CliRunner().invoke(main, ["report", *args], env={"GITHUB_STEP_SUMMARY": ""})


def page(tmp_path: Path, run: PageRun, *extra: str) -> tuple[dict[str, Any], str]:
    out = tmp_path / "report.html"
    res = report(str(run.results), "--input", str(run.inputs), "--html", str(out), *extra)
    assert res.exit_code == 0, res.output
    text = out.read_text(encoding="utf-8")
    return decode(text), text


def rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(zip(data["columns"], r)) for r in data["rows"]]


def test_page_json_markdown_and_junit_come_from_one_summary(tmp_path: Path,
                                                             page_run: PageRun) -> None:
    """The page's summary is the object --json prints; the Markdown's figures are made
    from it; the JUnit cases carry the statuses of the page's rows."""
    md, junit, html = tmp_path / "r.md", tmp_path / "r.xml", tmp_path / "r.html"
    res = report(str(page_run.results), "--json", "--baseline", str(page_run.baseline),
                 "--fail-under", "accuracy=0.5", "--markdown", str(md), "--junit", str(junit),
                 "--html", str(html), "--input", str(page_run.inputs))
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)
    data = decode(html.read_text(encoding="utf-8"))
    assert data["summary"] == printed
    assert printed["gates"][0]["passed"] and "baseline" in printed
    text = md.read_text(encoding="utf-8")
    for name, value in figures_rows(data["summary"]):
        assert f"| {name} | {value} |" in text
    statuses = {r["id"]: r["status"] for r in rows(data)}
    cases = {case.name: case for suite in JUnitXml.fromfile(str(junit)) for case in suite}
    assert set(cases) == set(statuses)
    for name, case in cases.items():
        kinds = {type(r).__name__ for r in case.result}
        expected = {"ok": set(), "error": {"Error"}, "wrong": {"Failure"},
                    "invalid": {"Failure"}}[statuses[name]]
        assert kinds == expected, name


def test_rows_count_what_the_summary_counts(tmp_path: Path, page_run: PageRun) -> None:
    data, _ = page(tmp_path, page_run, "--baseline", str(page_run.baseline))
    s = data["summary"]
    table = rows(data)
    assert [r["id"] for r in table] == ["q1", "q2", "person", "city", "weather", "broken",
                                        "slow", "pair", "q3"]
    assert sum(r["finish"] == "error" for r in table) == s["errors"] == 2
    assert sum(r["invalid_outputs"] for r in table) == s["schema_lines"] - s["valid"] == 4
    assert sum(r["closed_outputs"] for r in table) == sum(s["closed_early"].values()) == 1
    assert {r["id"]: r["changed"] for r in table if r["changed"]} == {
        "q1": "wrong->right", "q2": "right->wrong"}
    by_id = {r["id"]: r for r in table}
    assert by_id["city"]["closed"] == "limit" and by_id["city"]["valid"] is True
    assert by_id["pair"]["invalid_outputs"] == 2
    assert (by_id["person"]["tokens"], by_id["person"]["ttft_ms"]) == (12, 5.0)


def test_an_invalid_output_shows_its_validator_errors_with_paths(tmp_path: Path,
                                                                 page_run: PageRun) -> None:
    data, _ = page(tmp_path, page_run)
    details = {r["id"]: d for r, d in zip(rows(data), data["details"])}
    person = details["person"]
    assert [(e["path"], e["keyword"]) for e in person["schema_errors"]] == [
        ("$.age", "maximum"), ("$.name", "maxLength")]
    assert person["input"]["messages"][0]["content"] == "A person as JSON."
    weather = details["weather"]
    assert weather["schema_errors"][0]["path"] == "calls[0].arguments"
    assert "'city' is a required property" in weather["schema_errors"][0]["message"]
    assert weather["input"]["messages"][2]["role"] == "tool"  # the tool's result
    first, second = details["pair"]["choices"]
    assert [e["path"] for e in first["schema_errors"]] == ["$.age"]
    assert [e["path"] for e in second["schema_errors"]] == ["$.name"]
    assert "schema_errors" not in details["city"] and "schema_errors" not in details["slow"]
    assert details["q1"]["input"]["prompt"] == "2 + 2 ="
    assert data["made_with"] == [{"made_with": {"model": "tiny-llama", "quantize": "int4"},
                                  "lines": 9}]
    assert "made_with" not in details["q1"]


def test_without_input_or_with_an_edited_one_the_page_says_why(tmp_path: Path,
                                                               page_run: PageRun) -> None:
    out = tmp_path / "r.html"
    assert report(str(page_run.results), "--html", str(out)).exit_code == 0
    person = decode(out.read_text())["details"][2]
    assert "--input" in person["input_note"] and "--input" in person["schema_errors_note"]
    lines = page_run.inputs.read_bytes().splitlines(keepends=True)
    lines[2] = lines[2].replace(b"A person", b"One person")
    page_run.inputs.write_bytes(b"".join(lines))
    data, _ = page(tmp_path, page_run)
    assert "changed since the run" in data["details"][2]["input_note"]
    assert data["details"][0]["input"]["prompt"] == "2 + 2 ="


def test_options_that_need_html(tmp_path: Path, page_run: PageRun) -> None:
    res = report(str(page_run.results), "--input", str(page_run.inputs))
    assert res.exit_code == 2 and "--input goes with --html" in res.stderr
    missing = report(str(page_run.results), "--html", str(tmp_path / "no" / "r.html"))
    assert missing.exit_code == 2 and "cannot write --html" in missing.stderr
    gone = report(str(page_run.results), "--html", str(tmp_path / "r.html"), "--input",
                  str(tmp_path / "nope.jsonl"))
    assert gone.exit_code == 2 and "--input" in gone.stderr
    assert not (tmp_path / "r.html").exists()


def test_a_gate_that_fails_still_writes_the_page(tmp_path: Path, page_run: PageRun) -> None:
    out = tmp_path / "r.html"
    res = report(str(page_run.results), "--html", str(out), "--fail-under", "accuracy=0.9")
    assert res.exit_code == 3
    assert decode(out.read_text())["summary"]["gates"][0]["passed"] is False


def test_the_page_is_self_contained(tmp_path: Path, page_run: PageRun) -> None:
    """No script, style, image or font from anywhere, and a policy that forbids any."""
    _, text = page(tmp_path, page_run, "--baseline", str(page_run.baseline))
    assert "default-src 'none'" in text
    assert not re.search(r"<(script|link|img|iframe)[^>]*\s(src|href)=", text)
    assert not re.search(r"url\(|@import|https?://(?!www\.w3\.org/2000/svg)", text)
    assert text.count("<script") == 2  # the data, and the page's own script


EVIL = "</script><script>alert(1)</script> {{script}} <!--<script>"


def test_model_text_cannot_break_out_of_the_page(tmp_path: Path) -> None:
    rows = results()[:1]
    rows[0]["text"] = EVIL
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    out = tmp_path / "r.html"
    assert report(str(path), "--html", str(out)).exit_code == 0
    text = out.read_text()
    assert 'data-encoding="json"' in text  # a small page: the text is in the page as JSON
    assert text.count("<script") == 2 and text.count("</script>") == 2
    assert "<!--" not in text.split("<script", 1)[1]
    assert decode(text)["details"][0]["text"] == EVIL


# Allowed masses (min, mean) on report_pages.py's lines: `broken` and `slow` never
# weighed a constrained step; q1 and q2 tie, so file order keeps q1 first.
MASSES = {"pair": (0.002, 0.41), "person": (0.03, 0.5), "weather": (0.2, 0.6),
          "city": (0.5, 0.9), "q1": (0.9, 0.95), "q2": (0.9, 0.97), "q3": (1.0, 1.0)}
BENT_ORDER = ["pair", "person", "weather", "city", "q1", "q2", "q3"]
HOSTILE = "<script>window.pwned = 1</script><b>bold</b> {\"name\": \"x\"}"


def bent_results() -> list[dict[str, Any]]:
    """The run with allowed masses, `person`'s text hostile and `weather`'s long and
    over several lines (the page shows an excerpt of it)."""
    out = results()
    for line in out:
        if line["id"] in MASSES:
            low, mean = MASSES[line["id"]]
            line["stats"].update(allowed_mass_min=low, allowed_mass_mean=mean,
                                 allowed_mass_steps=4)
        if line["id"] == "person":
            line["text"] = HOSTILE
        if line["id"] == "weather":
            line["text"] = "<tool_call>\n" + '{"name": "get_weather", "arguments": {}}\n' * 4
    return out


def test_the_bent_section_lists_json_bent_most_lowest_first(tmp_path: Path) -> None:
    """The section's lines are the `bent_most` `--json` prints, carried as they are (no
    second ranking), each joined to its row by index and id; a line's hostile text stays
    text in the page."""
    path = write_jsonl(tmp_path / "r.jsonl", bent_results())
    out = tmp_path / "r.html"
    res = report(str(path), "--json", "--html", str(out))
    assert res.exit_code == 0, res.output
    printed = json.loads(res.stdout)["bent_most"]
    text = out.read_text(encoding="utf-8")
    data = decode(text)
    bent = data["summary"]["bent_most"]
    assert bent == printed
    assert [b["id"] for b in bent] == BENT_ORDER
    assert [(b["allowed_mass_min"], b["allowed_mass_mean"]) for b in bent] == [
        MASSES[name] for name in BENT_ORDER]
    # The key the page joins on names exactly one row, and that row is the line's.
    table = rows(data)
    for b in bent:
        [joined] = [r for r in table if r["index"] == b["index"] and r["id"] == b["id"]]
        assert joined["id"] == b["id"]
    by_id = {r["id"]: r for r in table}
    assert (by_id["pair"]["finish"], by_id["pair"]["valid"]) == ("stop", False)
    assert (by_id["city"]["finish"], by_id["city"]["valid"]) == ("stop", True)
    details = {r["id"]: d for r, d in zip(table, data["details"])}
    assert details["person"]["text"] == HOSTILE
    # The hostile text is in the page only as escaped JSON: no element of it is markup.
    assert "<script>window.pwned" not in text and "<b>bold" not in text
    assert text.count("<script") == 2
    # Shown only when there is something to show, from the summary's own list.
    assert '<section id="bent" aria-label="where the constraint bent the model" hidden>' in text
    assert "data.summary.bent_most" in text


def test_without_allowed_mass_the_bent_section_stays_hidden(tmp_path: Path,
                                                            page_run: PageRun) -> None:
    """An unconstrained run (no line carries an allowed mass) has an empty `bent_most`,
    and the page's section and its link in the nav stay hidden, as the baseline's do
    without a baseline."""
    data, text = page(tmp_path, page_run)
    assert data["summary"]["bent_most"] == []
    assert '<section id="bent" aria-label="where the constraint bent the model" hidden>' in text
    assert '<a href="#bent" id="nav-bent" hidden>' in text


def test_payload_compresses_only_where_it_pays() -> None:
    small = {"a": "x" * 100}
    assert encode(small)[0] == "json"
    big = {"rows": [{"text": f"line {i}", "valid": True} for i in range(COMPRESS_FROM // 10)]}
    encoding, text = encode(big)
    assert encoding == "gzip+base64" and len(text) < len(json.dumps(big)) / 3
    for value in (small, big, {"nan": float("nan"), "s": "\ud800"}):
        page = render({"title": "t", "summary": {}, **value})
        back = decode(page)
        assert back["title"] == "t"
    assert decode(render({"title": "t", "x": float("inf")}))["x"] == "inf"


def test_step_plot_marks_p50_and_p99() -> None:
    summary = {"lines": 3, "step_source": "steps", "steps": {
        f"{k}_ms": {"p50": 1.0, "p99": 2.0, "mean": m} for k, m in
        (("forward", 4.0), ("mask", 1.0), ("controller", 0.5), ("sample", 0.25))}}
    svg = step_svg(summary, [float(v) for v in range(1, 101)], "steps")
    assert svg.startswith("<svg") and "p50 50.00 ms" in svg and "p99 99.00 ms" in svg
    assert "forward 4.00 ms" in svg and "100 sequence-steps" in svg
    empty = step_svg({"lines": 0}, [], None)
    assert "no step timings" in empty and "no per-step data" in empty


def test_timeline_stays_small_for_big_runs() -> None:
    few = [Bar(i, i * 0.1, i * 0.1 + 1.0, "stop", i * 0.1 + 0.2) for i in range(20)]
    svg = timeline_svg(few, [Step(0.0, 0.05, "prefill"), Step(0.05, 0.1, "decode")], "trace")
    assert svg.count("<rect") == 20 + 1 + 2  # a bar each, the legend's swatch, two steps
    many = [Bar(i, i * 0.001, i * 0.001 + 2.0, "stop") for i in range(50_000)]
    steps = [Step(i * 0.001, i * 0.001 + 0.0008, "decode") for i in range(50_000)]
    big = timeline_svg(many, steps, "trace")
    assert len(big) < 40_000 and "lines in flight" in big
    assert len(many) > BARS


def test_columns_name_every_row_field() -> None:
    data = {"rows": [[0] * len(COLUMNS)]}
    assert len(COLUMNS) == len(set(COLUMNS)) == len(data["rows"][0])
    assert stats()["total_ms"] == 40.0


@pytest.mark.parametrize("encoding", ["json", "gzip+base64"])
def test_decode_reads_both_encodings(encoding: str) -> None:
    value = {"title": "t", "rows": list(range(10 if encoding == "json" else 20_000))}
    page = render(value)
    assert f'data-encoding="{encoding}"' in page
    assert decode(page) == value
