"""`aici-batch report` as a CI gate, through the CLI: `--fail-under`, `--baseline` with
`--fail-on-regression`, `--junit` (read back with junitparser, the JUnit reader CI
plugins are built on), `--markdown` and `$GITHUB_STEP_SUMMARY`, and the exit codes. The
statistics are checked against scipy (McNemar) and by properties (hypothesis)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from aici_cli.cli.main import main
from aici_cli.formats.jobs import load_schema
from aici_cli.report.baseline import mcnemar_p, paired_bootstrap

RESULT = Draft202012Validator(load_schema("result-line"))
STATS = {"prompt_tokens": 3, "output_tokens": 2, "forward_passes": 2, "ff_tokens": 0,
         "ttft_ms": 5.0, "total_ms": 250.0, "forward_ms": 4.0, "mask_ms": 0.0,
         "controller_ms": 0.0, "sample_ms": 0.0}


def line(i: int, text: str, answer: str | None = None, *, prompt: str | None = None,
         error: str | None = None, valid: bool | None = None, id_: str | None = None) -> dict:
    """A result line as a run writes it: its id, its input digest, text, verdict."""
    out: dict[str, Any] = {"id": id_ or f"q{i}", "index": i,
                           "input_sha256": hashlib.sha256(
                               (prompt or f"prompt {i}").encode()).hexdigest()[:16],
                           "text": text, "finish_reason": "error" if error else "stop",
                           "stats": dict(STATS)}
    if valid is not None:
        out["valid"] = valid
    if error is not None:
        out["error"] = {"type": error, "message": f"line {i}: {error} happened"}
    if answer is not None:
        out["answer"] = answer
        out["correct"] = error is None and text == answer
    RESULT.validate(out)
    return out


def write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def report(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["report", *args],
                              env={"GITHUB_STEP_SUMMARY": "", **(env or {})})


def eval_rows(right: int, wrong: int, start: int = 1) -> list[dict]:
    return ([line(start + k, " yes", " yes") for k in range(right)]
            + [line(start + right + k, " no", " yes") for k in range(wrong)])


# ------------------------------------------------------------------------------ gates


def test_fail_under_accuracy(tmp_path: Path) -> None:
    results = write(tmp_path / "r.jsonl", eval_rows(3, 1))
    ok = report(results, "--fail-under", "accuracy=0.75", "--fail-under", "error_rate=0")
    assert ok.exit_code == 0, ok.output
    assert "gate: accuracy 0.7500 passes accuracy >= 0.75" in ok.stdout
    bad = report(results, "--fail-under", "accuracy=80%")
    assert bad.exit_code == 3
    assert bad.stderr.strip() == ("aici-batch report: gate failed: accuracy 0.7500 is "
                                  "below the required 0.8 (--fail-under accuracy)")


def test_fail_under_compliance_both_ways_and_error_rate(tmp_path: Path) -> None:
    """4 schema lines: 2 valid, 1 invalid, 1 error: compliance 2/4, among those that ran
    2/3; the error rate is 1/4."""
    rows = [line(1, "{}", valid=True), line(2, "{}", valid=True), line(3, "{", valid=False),
            line(4, "", error="timeout", valid=False)]
    results = write(tmp_path / "r.jsonl", rows)
    out = report(results, "--json", "--fail-under", "compliance=0.5",
                 "--fail-under", "compliance_ran=0.66", "--fail-under", "error_rate=0.25")
    assert out.exit_code == 0, out.output
    gates = {g["metric"]: g for g in json.loads(out.stdout)["gates"]}
    assert gates["compliance"]["value"] == 0.5 and gates["compliance_ran"]["value"] == 0.6667
    assert gates["error_rate"]["value"] == 0.25 and gates["error_rate"]["upper"]
    failed = report(results, "--fail-under", "compliance_ran=0.7",
                    "--fail-under", "error_rate=0.2", "--fail-under", "compliance=0.5")
    assert failed.exit_code == 3
    assert failed.stderr.splitlines() == [
        "aici-batch report: gate failed: compliance_ran 0.6667 is below the required 0.7 "
        "(--fail-under compliance_ran)",
        "aici-batch report: gate failed: error_rate 0.2500 is above the allowed 0.2 "
        "(--fail-under error_rate)"]


def test_fail_under_tokens_per_s_needs_the_run_summary(tmp_path: Path) -> None:
    results = write(tmp_path / "r.jsonl", eval_rows(2, 0))
    alone = report(results, "--fail-under", "tok/s=10")
    assert alone.exit_code == 2
    assert alone.stderr.strip() == ("Error: --fail-under tokens_per_s needs --stats FILE "
                                    "(the run's --stats-out): results alone have no wall "
                                    "time")
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps(_stats(tokens_per_s=42.5)))
    assert report(results, "--stats", str(stats), "--fail-under", "tokens_per_s=40").exit_code == 0
    slow = report(results, "--stats", str(stats), "--fail-under", "tokens_per_s=50")
    assert slow.exit_code == 3
    assert "tokens_per_s 42.5 is below the required 50" in slow.stderr


def test_a_gate_without_its_figure_fails(tmp_path: Path) -> None:
    results = write(tmp_path / "r.jsonl", [line(1, "x"), line(2, "y")])
    out = report(results, "--fail-under", "accuracy=0.1")
    assert out.exit_code == 3
    assert out.stderr.strip().endswith("no accuracy to check: no line has an expected answer")


@pytest.mark.parametrize(("spec", "message"), [
    ("accuracy", "expected METRIC=VALUE with METRIC one of accuracy, compliance, "
                 "compliance_ran, error_rate, tokens_per_s"),
    ("speed=3", "expected METRIC=VALUE"),
    ("accuracy=high", "'high' is not a number"),
    ("accuracy=1.5", "accuracy must be between 0 and 1 (or 0% and 100%)"),
])
def test_a_bad_gate_is_a_usage_error(tmp_path: Path, spec: str, message: str) -> None:
    results = write(tmp_path / "r.jsonl", eval_rows(1, 0))
    out = report(results, "--fail-under", spec)
    assert out.exit_code == 2
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr


# --------------------------------------------------------------------------- baseline


def test_baseline_matches_by_id_and_digest_and_counts_changes(tmp_path: Path) -> None:
    before = [line(1, " yes", " yes"), line(2, " no", " yes"), line(3, " yes", " yes"),
              line(4, " yes", " yes"), line(5, " a", None), line(6, " yes", " yes"),
              line(7, " yes", " yes")]
    now = [line(1, " no", " yes"), line(2, " yes", " yes"), line(3, " yes", " yes"),
           line(4, " no", " yes"), line(5, " b", None),
           line(6, " no", " yes", prompt="an edited prompt"),  # same id, other input
           line(8, " yes", " yes")]  # new
    prev, results = write(tmp_path / "prev.jsonl", before), write(tmp_path / "r.jsonl", now)
    out = report(results, "--baseline", prev, "--json")
    assert out.exit_code == 0, out.output
    b = json.loads(out.stdout)["baseline"]
    assert (b["matched"], b["only_now"], b["only_baseline"], b["input_changed"]) == (5, 1, 1, 1)
    assert b["paired"] == 4 and (b["right_to_wrong"], b["wrong_to_right"]) == (2, 1)
    assert b["accuracy_before"] == 0.75 and b["accuracy_now"] == 0.5 and b["delta"] == -0.25
    assert b["mcnemar_p"] == 1.0  # 3 discordant lines prove nothing
    low, high = b["delta_95ci"]
    assert -1 <= low <= -0.25 <= high <= 1
    ways = {c["id"]: c["way"] for c in b["changed"]}
    assert ways == {"q1": "right->wrong", "q2": "wrong->right", "q4": "right->wrong",
                    "q5": "changed"}
    text = report(results, "--baseline", prev)
    assert "baseline: 5 lines matched" in text.stdout
    assert "4 answers changed: 2 right->wrong, 1 wrong->right" in text.stdout


def test_fail_on_regression_only_when_the_drop_is_significant(tmp_path: Path) -> None:
    prev = write(tmp_path / "prev.jsonl", eval_rows(40, 0))
    small = write(tmp_path / "small.jsonl", eval_rows(38, 2))  # 2 of 40 flipped: noise
    large = write(tmp_path / "large.jsonl", eval_rows(28, 12))  # 12 of 40: significant
    assert report(small, "--baseline", prev, "--fail-on-regression").exit_code == 0
    out = report(large, "--baseline", prev, "--fail-on-regression")
    assert out.exit_code == 3
    p = mcnemar_p(12, 0)
    assert out.stderr.strip() == (
        "aici-batch report: gate failed: accuracy fell 0.3000 (1.0000 -> 0.7000) on 40 "
        f"paired lines against {prev}: 12 right->wrong, 0 wrong->right, McNemar p = "
        f"{p:.4g} < 0.05 (--fail-on-regression)")
    # A stricter level than the evidence: passes.
    assert report(large, "--baseline", prev, "--fail-on-regression",
                  "--alpha", str(p / 2)).exit_code == 0
    # Without --fail-on-regression a drop is reported, not gated.
    assert report(large, "--baseline", prev).exit_code == 0


def test_fail_on_regression_needs_a_baseline(tmp_path: Path) -> None:
    out = report(write(tmp_path / "r.jsonl", eval_rows(1, 0)), "--fail-on-regression")
    assert out.exit_code == 2
    assert out.stderr.strip() == ("Error: --fail-on-regression needs --baseline PREV.jsonl "
                                  "(the last run's results)")


def test_a_bad_baseline_fails_before_anything_is_written(tmp_path: Path) -> None:
    results = write(tmp_path / "r.jsonl", eval_rows(1, 0))
    bad = tmp_path / "prev.jsonl"
    bad.write_text('{"id": "x"}\n')
    junit = tmp_path / "junit.xml"
    out = report(results, "--baseline", str(bad), "--junit", str(junit))
    assert out.exit_code == 2 and "--baseline" in out.stderr and "line 1" in out.stderr
    assert not junit.exists()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60))
def test_mcnemar_is_scipys_exact_binomial_test(b: int, c: int) -> None:
    scipy_stats = pytest.importorskip("scipy.stats")
    expected = scipy_stats.binomtest(min(b, c), b + c, 0.5).pvalue if b + c else 1.0
    assert mcnemar_p(b, c) == pytest.approx(expected, rel=1e-9)
    assert mcnemar_p(b, c) == mcnemar_p(c, b)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300).flatmap(
    lambda n: st.tuples(st.just(n), st.integers(0, n)).flatmap(
        lambda t: st.tuples(st.just(t[0]), st.just(t[1]), st.integers(0, t[0] - t[1])))))
def test_bootstrap_interval_holds_the_observed_delta(nbc: tuple[int, int, int]) -> None:
    """The interval lies in [-1, 1], holds the observed delta, and mirrors when the runs
    swap (to Monte Carlo noise and the 1/n grid); with every pair discordant one way it
    is a single point."""
    n, b, c = nbc
    low, high = paired_bootstrap(b, c, n, iterations=2000)
    assert -1 <= low <= (c - b) / n <= high <= 1
    mirror = paired_bootstrap(c, b, n, iterations=2000)
    slack = 2 / n + 0.01
    assert mirror[0] == pytest.approx(-high, abs=slack)
    assert mirror[1] == pytest.approx(-low, abs=slack)
    if b == n or c == n:
        assert low == high == (c - b) / n


# ---------------------------------------------------------------------- junit, markdown


def test_junit_one_case_per_line_read_back_by_junitparser(tmp_path: Path) -> None:
    junitparser = pytest.importorskip("junitparser")
    rows = [line(1, " yes", " yes"), line(2, " no", " yes"), line(3, "{", valid=False),
            line(4, "", " yes", error="timeout"), line(5, "free <text> & \x01", None)]
    junit = tmp_path / "junit.xml"
    out = report(write(tmp_path / "eval.jsonl", rows), "--junit", str(junit))
    assert out.exit_code == 0, out.output
    xml = junitparser.JUnitXml.fromfile(str(junit))
    [suite] = list(xml)
    assert (suite.name, suite.tests, suite.failures, suite.errors) == ("eval", 5, 2, 1)
    cases = {case.name: case for case in suite}
    assert list(cases) == ["q1", "q2", "q3", "q4", "q5"]
    assert cases["q1"].is_passed and cases["q5"].is_passed
    [wrong] = cases["q2"].result
    assert isinstance(wrong, junitparser.Failure) and wrong.type == "wrong"
    assert wrong.message == "wrong answer: answered ' no', expected ' yes'"
    [invalid] = cases["q3"].result
    assert isinstance(invalid, junitparser.Failure) and invalid.type == "invalid"
    [error] = cases["q4"].result
    assert isinstance(error, junitparser.Error) and error.type == "timeout"
    assert error.message == "line 4: timeout happened"
    assert cases["q2"].system_out == "id: q2\nline: 2\nanswer:  no\nexpected:  yes"
    assert cases["q1"].time == pytest.approx(0.25)
    assert "\ufffd" in cases["q5"].system_out  # a control character XML cannot hold


def test_markdown_file_and_the_github_step_summary(tmp_path: Path) -> None:
    prev = write(tmp_path / "prev.jsonl", eval_rows(3, 1))
    results = write(tmp_path / "r.jsonl", [line(1, " no", " yes"), *eval_rows(2, 1, 2)])
    md = tmp_path / "summary.md"
    out = report(results, "--markdown", str(md), "--baseline", prev,
                 "--fail-under", "accuracy=0.9")
    assert out.exit_code == 3
    text = md.read_text()
    assert text.startswith(f"## aici-batch report: {results}\n")
    assert "| accuracy | 50.00% of 4 lines |" in text
    assert "| `accuracy >= 0.9` | 0.5 | ❌ fail |" in text
    assert "<details><summary>Changed answers (1)</summary>" in text
    assert "| q1 | right->wrong |  yes |  no |  yes |" in text
    summary = tmp_path / "step_summary.md"
    summary.write_text("earlier step\n")
    again = report(results, env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert again.exit_code == 0
    assert summary.read_text().startswith("earlier step\n## aici-batch report:")


def _stats(**overrides: Any) -> dict[str, Any]:
    steps = {k: {"p50": 1.0, "p99": 1.0, "mean": 1.0}
             for k in ("forward_ms", "mask_ms", "controller_ms", "sample_ms", "overhead_ms",
                       "step_ms")}
    base = {"lines": 2, "errors": 0, "prompt_tokens": 6, "output_tokens": 4, "ff_tokens": 0,
            "row_forward_passes": 4, "forward_passes_per_token": 1.0, "forward_passes": 2,
            "wall_s": 0.1, "tokens_per_s": 40.0, "steps": steps, "model": "m",
            "device": "cpu", "dtype": "float32", "batch_size": 8, "schema_lines": 0,
            "valid": 0, "schema_errors": 0, "answered": 2, "accuracy": 1.0,
            "cached_tokens": 0,
            "prefix_hit_rate": 0.0}
    base.update(overrides)
    Draft202012Validator(load_schema("stats")).validate(base)
    return base
