"""`aici-batch report`: summarize a results JSONL after the fact, optionally plot it.

A run's own summary (`--stats-out`) is exact but only exists if it was asked for; the
results file always exists. So the report derives everything it can from result lines
alone and takes the run-level figures (wall time, tokens/s, batched passes, model) from
the run summary only when one is given: per-sequence `total_ms` overlap in a batch, so
summing or averaging them says nothing about the run's throughput.

Step timings in result lines are per *sequence*: a `steps` record (with `--step-stats`)
carries the shared batched pass's forward/mask/sample time plus that sequence's own
controller time, and a batch of 8 yields 8 records per pass. Distributions derived from
results are therefore over sequence-steps, not over the engine's batched passes as in
the run summary; `step_source` says which one a summary holds.
"""

from __future__ import annotations

import heapq
import json
import math
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from json.scanner import c_make_scanner  # type: ignore[attr-defined]
from pathlib import Path
from typing import Any

from jsonschema.exceptions import best_match
from rich.table import Table

from aici_cli.core.errors import ReportError
from aici_cli.core.line_stats import TIMING_FIELDS
from aici_cli.formats.openai_batch import as_result
from aici_cli.formats.schemas import schema_check, schema_validator
from aici_cli.report.plot import plot, pyplot_figure
from aici_cli.run.tally import RunTally, compliance, compliance_rows, outcome_rows, percentile

#: Figures only the run summary knows exactly; taken from a stats file when given.
RUN_LEVEL_FIELDS = (
    "forward_passes", "wall_s", "tokens_per_s", "model", "device", "dtype", "batch_size",
)

NO_RUN_SUMMARY_NOTE = (
    "tokens/s, wall time and batched forward passes need the run summary "
    "(run with --stats-out FILE, report with it): per-sequence total_ms overlap in a "
    "batch, so results alone cannot give them"
)


# ------------------------------------------------------------------------- reading


def _schema_problem(name: str, value: Any) -> str | None:
    """The most relevant schema violation as `where: what`, or None when valid.

    Asked only about a value `schema_check` found invalid: searching for the most
    relevant error costs ~30x more than the yes/no check every line gets."""
    err = best_match(schema_validator(name).iter_errors(value))
    if err is None:
        return None
    where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
    return f"{where}: {err.message}"


_timings = operator.itemgetter(*TIMING_FIELDS)

# json's own C scanner, the one `json.loads` ends in: called directly, it skips three
# Python calls and two regex matches a line, a tenth of a 100,000-line report.
_scan = c_make_scanner(json.JSONDecoder()) if c_make_scanner is not None else None


def _loads(text: str) -> Any:
    """`json.loads(text)` for a stripped `text`: the scanner's value when it reads the
    whole text; anything else goes to `json.loads`, which raises its own error."""
    if _scan is not None:
        try:
            value, end = _scan(text, 0)
        except (StopIteration, ValueError, RecursionError):
            end = -1
        if end == len(text):
            return value
    return json.loads(text)


def parse_results(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """Parse result lines lazily, checking each against the result-line schema.

    Blank lines are skipped but still counted, so `line N` in an error is the physical
    line an editor shows. Checking the schema here means every figure below can index
    fields without guarding, and a file from something else fails loudly, not as zeros.
    """
    valid = schema_check("result-line")
    for n, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            value = _loads(text)
        except json.JSONDecodeError as e:
            raise ReportError(f"line {n}: not JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(value, dict):
            raise ReportError(f"line {n}: expected a result object, got {type(value).__name__}")
        value = as_result(value)  # an OpenAI batch output line, read as a result line
        if not valid(value):
            problem = _schema_problem("result-line", value)
            raise ReportError(f"line {n}: not a result line: {problem}")
        yield value


# ------------------------------------------------------------------------- summary


def _distribution(values: Sequence[float], mean: float | None = None) -> dict[str, float]:
    """p50/p99/mean rounded like `stats.step_summary`, so derived and run figures compare."""
    if mean is None:
        mean = sum(values) / len(values) if values else 0.0
    return {
        "p50": round(percentile(values, 50), 3),
        "p99": round(percentile(values, 99), 3),
        "mean": round(mean, 3),
    }


# Lines `report` names as the ones the constraint bent most.
BENT_MOST = 10


@dataclass
class ResultTally(RunTally):
    """Everything the summary and the plot need, gathered in one pass over the results
    (stdin can be read only once): the run's counts, plus finish reasons and timings."""

    # Per-step records (--step-stats): each sequence-step's TIMING_FIELDS, as written.
    record_rows: list[tuple[float, ...]] = field(default_factory=list)
    # Per-sequence fallback: each sequence that ran a pass, its TIMING_FIELDS and passes.
    seq_rows: list[tuple[tuple[float, ...], int]] = field(default_factory=list)
    ran: int = 0  # results with at least one forward pass
    ran_without_steps: int = 0
    # The lines the constraint bent most: a heap of the BENT_MOST lowest allowed masses,
    # (-mass, order, entry) so that heapq's smallest is the highest of those kept.
    bent: list[tuple[float, int, dict[str, Any]]] = field(default_factory=list)
    weighed: int = 0  # results that carry an allowed mass (the heap's tie-break: file order)

    def add(self, result: dict[str, Any]) -> None:
        super().add(result)  # the counts, by the run's own rules
        # One append a line (a C-level itemgetter's tuple): this runs for every line of a
        # 100,000-line file; the figures are made from the rows once, at the end.
        st = result["stats"]
        passes = st["forward_passes"]
        if passes > 0:
            self.ran += 1
            self.seq_rows.append((_timings(st), passes))
            if "steps" not in result:
                self.ran_without_steps += 1
        records = result.get("steps")
        if records:
            self.record_rows.extend(map(_timings, records))
        low = st.get("allowed_mass_min")
        if low is not None:
            entry = {"index": result.get("index"), "id": result.get("id"),
                     "allowed_mass_min": low, "allowed_mass_mean": st.get("allowed_mass_mean")}
            self.weighed += 1
            item = (-low, -self.weighed, entry)  # on a tie, the earlier line stays
            if len(self.bent) < BENT_MOST:
                heapq.heappush(self.bent, item)
            elif item > self.bent[0]:
                heapq.heapreplace(self.bent, item)

    def bent_most(self) -> list[dict[str, Any]]:
        """The BENT_MOST lines whose constraint left the model the least probability at
        some step (`stats.allowed_mass_min`), lowest first."""
        return [entry for _, _, entry in sorted(self.bent, reverse=True)]

    @property
    def record_totals(self) -> list[float]:
        """Each step's total (forward+mask+controller+sample), to the microsecond."""
        return [round(sum(r), 3) for r in self.record_rows]

    def record_values(self, i: int) -> list[float]:
        """Every step's value of TIMING_FIELDS[i]."""
        return [float(r[i]) for r in self.record_rows]

    @property
    def seq_totals(self) -> list[float]:
        """Each sequence's total per pass."""
        return [sum(t) / passes for t, passes in self.seq_rows]

    def seq_values(self, i: int) -> list[float]:
        """Each sequence's TIMING_FIELDS[i] per pass."""
        return [t[i] / passes for t, passes in self.seq_rows]

    def seq_sum(self, i: int) -> float:
        """TIMING_FIELDS[i] over every sequence, added in file order."""
        total = 0.0
        for t, _ in self.seq_rows:
            total += t[i]
        return total

    @property
    def step_source(self) -> str | None:
        """"steps" only when every sequence that ran carries its records: a mix (results
        of runs with and without --step-stats concatenated) would weigh some sequences by
        their steps and ignore others, so it falls back to the per-sequence figures."""
        if self.ran == 0:
            return None
        return "steps" if self.ran_without_steps == 0 else "per-sequence"

    def step_totals(self) -> list[float]:
        """Per-step total times (forward+mask+controller+sample) for the histogram."""
        return self.record_totals if self.step_source == "steps" else self.seq_totals

    def steps(self) -> dict[str, dict[str, float]]:
        source = self.step_source
        if source == "steps":
            return {f: _distribution(self.record_values(i)) for i, f in enumerate(TIMING_FIELDS)}
        if source == "per-sequence":
            # p50/p99 over per-sequence averages; the mean is weighted by passes
            # (sum of ms / sum of passes), the true mean per sequence-step, so it
            # agrees with the "steps" source on the same run.
            return {
                f: _distribution(self.seq_values(i), self.seq_sum(i) / self.row_forward_passes)
                for i, f in enumerate(TIMING_FIELDS)
            }
        return {}

    def summary(self) -> dict[str, Any]:
        notes = [NO_RUN_SUMMARY_NOTE]
        if self.step_source == "per-sequence" and self.ran_without_steps < self.ran:
            notes.append(
                f"{self.ran_without_steps} of {self.ran} sequences have no per-step records: "
                "step timings come from per-sequence averages"
            )
        return {
            **self.counts(),
            "forward_passes": None,
            "wall_s": None,
            "tokens_per_s": None,
            **compliance(self.valid, self.schema_lines, self.schema_errors),
            "error_types": dict(sorted(self.error_types.items(), key=lambda kv: -kv[1])),
            "finish_reasons": dict(sorted(self.finish_reasons.items(), key=lambda kv: -kv[1])),
            "steps": self.steps(),
            "step_source": self.step_source,
            "bent_most": self.bent_most(),
            "model": None,
            "device": None,
            "dtype": None,
            "batch_size": None,
            "notes": notes,
        }


def _tally(lines: Iterable[str],
           on_result: Callable[[dict[str, Any]], None] | None = None) -> ResultTally:
    tally = ResultTally()
    for result in parse_results(lines):
        tally.add(result)
        if on_result is not None:
            on_result(result)
    return tally


def summarize_results(lines: Iterable[str]) -> dict[str, Any]:
    """Summarize result lines (JSONL text, one line per item) from results alone.

    Keys follow the run summary (`schemas/stats.schema.json`) plus `compliance` (valid
    over every schema line, errors included: JSONSchemaBench's), `compliance_ran` (over
    the schema lines that ran to the end), `error_types`, `finish_reasons`, `step_source`
    and `notes`. Run-level figures (`forward_passes`, `wall_s`, `tokens_per_s`, `model`,
    `device`, `dtype`, `batch_size`) are None: they cannot be derived from results (see
    `report`).
    `steps` holds p50/p99/mean of forward/mask/controller/sample ms per sequence-step,
    from `steps` records when every sequence that ran has them ("steps"), else from
    stats.X_ms / stats.forward_passes per sequence ("per-sequence"); {} and None when
    no sequence ran a pass. Raises ReportError naming the line for a malformed line.
    """
    return _tally(lines).summary()


# ------------------------------------------------------------------------- report


def _read_stats(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ReportError(f"{path}: cannot read the stats file: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: the stats file is not JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ReportError(f"{path}: not a run summary (expected a JSON object)")
    problem = None if schema_check("stats")(value) else _schema_problem("stats", value)
    if problem is not None:
        raise ReportError(f"{path}: not a run summary (--stats-out): {problem}")
    return value


def merge_run_summary(summary: dict[str, Any], stats: dict[str, Any]) -> dict[str, Any]:
    """Overlay the run summary's exact run-level figures on a derived summary (in place,
    and returned). Counts stay as derived from the results, which is the file being
    reported on; a disagreement is kept as a note because it usually means the stats
    file belongs to another run (or the results were filtered)."""
    for key in RUN_LEVEL_FIELDS:
        summary[key] = stats[key]
    if "guest_call_ms" in stats:
        summary["guest_call_ms"] = stats["guest_call_ms"]
    summary["steps"] = stats["steps"]  # per batched pass, with overhead_ms and step_ms
    summary["step_source"] = "stats"
    notes = [n for n in summary.get("notes", []) if n != NO_RUN_SUMMARY_NOTE]
    for key in ("lines", "output_tokens"):
        if stats[key] != summary[key]:
            notes.append(
                f"the stats file counts {key} {stats[key]}, the results {summary[key]}: "
                "run-level figures may be from another run"
            )
    summary["notes"] = notes
    return summary


def read_report(results_path: str | Path, stats_path: str | Path | None = None,
                on_result: Callable[[dict[str, Any]], None] | None = None,
                ) -> tuple[dict[str, Any], ResultTally]:
    """The summary of a results file ("-": stdin), merged with a run summary when given,
    and the tally it was made from (the step totals the plots draw). `on_result` sees
    every result line of the one pass (stdin cannot be read twice)."""
    stats = _read_stats(Path(stats_path)) if stats_path is not None else None
    if str(results_path) == "-":
        tally = _tally(sys.stdin, on_result)
    else:
        path = Path(results_path)
        try:
            with path.open(encoding="utf-8") as fh:
                tally = _tally(fh, on_result)
        except OSError as e:
            raise ReportError(f"{path}: cannot read the results: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ReportError(f"{path}: not UTF-8 text: {e.reason}") from None
    summary = tally.summary()
    if stats is not None:
        merge_run_summary(summary, stats)
    return summary, tally


def report(results_path: str | Path, stats_path: str | Path | None = None,
           plot_to: str | Path | None = None,
           on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Summarize a results file ("-": stdin), merging a run summary when given.

    The stats file is used only when passed explicitly: guessing one by name could
    silently pair results with a stale run. With `plot_to` the figure is drawn from the
    same single pass (stdin cannot be read twice); matplotlib is checked before reading
    so a missing one fails fast. `on_result` sees every result line of that pass
    (the CI outputs' per-line views, `report/lines.py`).
    """
    if plot_to is not None:
        pyplot_figure()  # fails fast without matplotlib
    summary, tally = read_report(results_path, stats_path, on_result)
    if plot_to is not None:
        plot(summary, plot_to, tally.step_totals(), tally.step_source)
    return summary


# ------------------------------------------------------------------------- table


def _num(value: Any, fmt: str = "", unit: str = "", missing: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return missing
    return f"{value:{fmt}}{unit}"


_SOURCE_CAPTIONS = {
    "steps": "step timings: per-step records, per sequence-step (--step-stats)",
    "per-sequence": "step timings: per-sequence averages per pass (no --step-stats)",
    "stats": "step timings: per batched pass, from the run summary",
}


def report_table(summary: dict[str, Any]) -> Table:
    """A report summary as a rich table. Its own table rather than `ui.summary_table`:
    a report from results alone has no wall time, tokens/s or batched pass count, and
    says so instead of failing on them. (Long because it lists every row of the table.)"""
    table = Table(title="aici-batch report", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    need = "n/a (needs --stats-out)"
    rows = outcome_rows(summary)
    rows += [
        ("prompt tokens", str(summary["prompt_tokens"])),
        ("  from the prefix cache", str(summary.get("cached_tokens", 0))),
        ("output tokens", str(summary["output_tokens"])),
        ("fast-forwarded tokens", str(summary["ff_tokens"])),
        ("forward passes (batched)", _num(summary.get("forward_passes"), missing=need)),
        ("row forward passes", str(summary["row_forward_passes"])),
        ("row passes per output token", _num(summary.get("forward_passes_per_token"), ".4f")),
        ("wall time", _num(summary.get("wall_s"), ".2f", " s", missing=need)),
        ("tokens/s", _num(summary.get("tokens_per_s"), ".1f", missing=need)),
    ]
    if summary.get("answered"):
        rows.append(("accuracy", f"{summary['accuracy']:.1%} of {summary['answered']} lines"))
    rows += compliance_rows(summary) or [("schema outputs valid", "- (no schema lines)")]
    for key in ("model", "device", "dtype", "batch_size"):
        if summary.get(key) is not None:
            rows.append((key.replace("_", " "), str(summary[key])))
    if summary.get("guest_call_ms"):
        g = summary["guest_call_ms"]
        rows.append(("controller call p50 / p99", f"{g['p50']:.3f} / {g['p99']:.3f} ms"))
    steps = summary.get("steps") or {}
    for name, dist in steps.items():
        rows.append((
            f"step {name} p50 / p99 / mean",
            f"{dist['p50']:.2f} / {dist['p99']:.2f} / {dist['mean']:.2f}",
        ))
    if not steps:
        rows.append(("step timings", "- (no forward passes)"))
    for k, bent in enumerate(summary.get("bent_most") or []):
        name = bent["id"] if bent.get("id") is not None else f"line {bent['index']}"
        rows.append(("bent most by the constraint" if k == 0 else "",
                     f"{name}: {bent['allowed_mass_min']:.2g} min, "
                     f"{bent['allowed_mass_mean']:.2g} mean allowed mass"))
    for name, value in rows:
        table.add_row(name, value)
    captions = []
    source = summary.get("step_source")
    if source in _SOURCE_CAPTIONS:
        captions.append(_SOURCE_CAPTIONS[source])
    captions += summary.get("notes", [])
    if captions:
        table.caption = "\n".join(captions)
    return table


# ------------------------------------------------------------------------- plot
