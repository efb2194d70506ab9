"""What a run shows on stderr: a progress bar on a terminal, a summary table at the end.

stdout carries results only. `quiet` silences all of this (errors still reach stderr
through the CLI).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

from aici_cli.models.progress import LoadProgress, SilentProgress
from aici_cli.stats import STEP_FIELDS, compliance_rows

T = TypeVar("T")


def load_progress(stream: IO[str], quiet: bool) -> LoadProgress:
    """How getting the model ready shows on stderr: nothing with `quiet`."""
    return SilentProgress() if quiet else ConsoleProgress(Console(file=stream, stderr=True))


class ConsoleProgress(LoadProgress):
    """The slow steps of getting a model ready (a GGUF conversion, once per model and
    machine) in the run's own style: a line saying what starts, and on a terminal one bar
    while it goes (a CI log gets the line only)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def note(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False, soft_wrap=True)

    def steps(self, items: Iterable[T], total: int, description: str) -> Iterator[T]:
        if not self.console.is_terminal:
            yield from items
            return
        with Progress(TextColumn("[bold]aici-batch"), TextColumn(escape(description)),
                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=self.console, transient=True) as bar:
            task = bar.add_task("load", total=total or None)
            for item in items:
                yield item
                bar.advance(task)


class RunDisplay:
    """Progress while a run goes, the summary table after it. A context manager."""

    def __init__(self, stream: IO[str], total: int | None, quiet: bool = False,
                 console: Console | None = None) -> None:
        self.console = console or Console(file=stream, stderr=True)
        self.quiet = quiet
        self.total = total
        self.tokens = 0
        self.progress: Progress | None = None
        self.task: Any = None
        if not quiet and self.console.is_terminal:
            self.progress = Progress(
                TextColumn("[bold]aici-batch"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("{task.fields[errors]} errors"),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=True,
            )
            self.task = self.progress.add_task("run", total=total, tps="-", errors=0)
        self.errors = 0

    def __enter__(self) -> RunDisplay:
        if self.progress is not None:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()

    def advance(self, result: dict[str, Any]) -> None:
        self.tokens += int(result.get("stats", {}).get("output_tokens", 0))
        self.errors += result.get("finish_reason") == "error"
        if self.progress is None:
            return
        elapsed = self.progress.tasks[0].elapsed or 0.0
        tps = f"{self.tokens / elapsed:.1f}" if elapsed > 0 else "-"
        self.progress.update(self.task, advance=1, tps=tps, errors=self.errors)

    def summary(self, summary: dict[str, Any]) -> None:
        if self.quiet:
            return
        self.console.print(summary_table(summary))


def _cached(summary: dict[str, Any]) -> str:
    """`cached / prompt (rate)`: the prefill the prefix cache saved."""
    cached, prompt = summary.get("cached_tokens", 0), summary.get("prompt_tokens", 0)
    return f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "0"


def summary_table(summary: dict[str, Any]) -> Table:
    """The run summary as a rich table (also used by `aici-batch report`)."""
    table = Table(title="aici-batch run", show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("lines", str(summary["lines"])),
        ("errors", str(summary["errors"])),
        ("output tokens", str(summary["output_tokens"])),
        ("fast-forwarded tokens", str(summary["ff_tokens"])),
        ("prompt tokens from the prefix cache", _cached(summary)),
        ("forward passes (batched)", str(summary["forward_passes"])),
        ("row passes per output token", str(summary["forward_passes_per_token"])),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f}"),
    ]
    if summary.get("answered"):
        rows.append(("accuracy", f"{summary['accuracy']:.1%} of {summary['answered']}"))
    rows += compliance_rows(summary)
    if "guest_call_ms" in summary:
        g = summary["guest_call_ms"]
        rows.append(("controller call p50 / p99", f"{g['p50']:.3f} / {g['p99']:.3f} ms"))
    for worker in summary.get("ray", {}).get("workers", []):
        rows.append((f"worker {worker['worker']} ({worker['node']})",
                     f"{worker['lines_per_s']:.2f} lines/s, {worker['tokens_per_s']:.1f} tok/s"))
    for name, value in rows:
        table.add_row(name, value)
    steps = summary.get("steps", {})
    for name in STEP_FIELDS:
        if name in steps:
            s = steps[name]
            table.add_row(f"step {name} p50 / p99", f"{s['p50']:.2f} / {s['p99']:.2f}")
    return table
