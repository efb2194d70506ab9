"""`ResultSink`: where each result goes the moment its line finishes, whatever backend
ran it: tagged with its input line's digest and what made it, turned into the output
format, written in one write (with `--ordered`, once the lines before it are out),
counted, shown, and handed to the caller. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from aici_cli.core.job import BadLine, Job
from aici_cli.formats.openai_batch import BatchFormat
from aici_cli.run.ordered import InputOrder
from aici_cli.run.result_writer import ResultWriter
from aici_cli.run.resume import InputLines
from aici_cli.run.tally import RunTally
from aici_cli.run.ui import RunDisplay


class ResultSink:
    """The run's `Emit`: see the module docstring. `after` is called after each result
    (the run's check for news of an interrupt: once the input is all read, the engine no
    longer asks to admit)."""

    def __init__(self, lines: InputLines, writer: ResultWriter, display: RunDisplay,
                 batch_format: BatchFormat | None,
                 on_result: Callable[[dict[str, Any]], None] | None,
                 after: Callable[[], None], made_with: dict[str, Any] | None = None,
                 ordered: bool = False) -> None:
        self.lines = lines
        # --ordered: results wait here for the lines before them (None: written at once).
        self.order: InputOrder[tuple[dict[str, Any], dict[str, Any]]] | None = (
            InputOrder(self._write) if ordered else None)
        self.made_with = made_with  # what made every result (`aici_cli.run.made_with`)
        self.schema_lines: set[int] = set()  # lines in flight that ask for a JSON schema
        self.writer = writer
        self.display = display
        self.batch_format = batch_format
        self.on_result = on_result
        self.after = after
        self.tally = RunTally()

    def __call__(self, result: dict[str, Any]) -> None:
        result = self.lines.tag(result, self.made_with)
        if result.get("index") in self.schema_lines:
            self.schema_lines.discard(result["index"])
            if result.get("finish_reason") == "error":
                result = _schema_error(result)
        fmt = self.batch_format
        line = fmt.output(result) if fmt is not None else result
        if self.order is not None:
            self.order.put(int(result.get("index", 0)), (line, result))
        else:
            self._write((line, result))
        self.tally.add(result)
        self.display.advance(result)
        self.after()

    def not_done(self, items: Iterator[Job | BadLine]) -> Iterator[Job | BadLine]:
        """`items` without those of lines that already have a result (`InputLines` hands
        those on as blank lines, which `read_jobs` skips; this keeps that true whatever it
        does with them), noting the lines that ask for JSON under a schema, and with
        `--ordered` tracked in input order."""
        def kept() -> Iterator[Job | BadLine]:
            for item in items:
                if item.index in self.lines.skip:
                    continue
                if item.json_schema if isinstance(item, BadLine) else (
                        item.constraint is not None and item.constraint.kind == "json_schema"):
                    self.schema_lines.add(item.index)
                yield item

        return kept() if self.order is None else self.order.track(kept())

    @property
    def full(self) -> bool:
        """`--ordered` holds as many results as it may: admit no new line for now."""
        return self.order is not None and self.order.full

    def flush(self) -> None:
        """Write what `--ordered` still holds (the lines after a gap an interrupt left),
        and sync the output."""
        if self.order is not None:
            self.order.flush()
        self.writer.sync()

    def _write(self, item: tuple[dict[str, Any], dict[str, Any]]) -> None:
        line, result = item
        self.writer.write(line)
        if self.on_result is not None:
            self.on_result(result)


def _schema_error(result: dict[str, Any]) -> dict[str, Any]:
    """An error result of a line that asked for JSON under a schema, with `valid: false`
    (no valid output came), so compliance over every schema line counts it."""
    if "valid" in result:
        return result
    out: dict[str, Any] = {}
    for key, value in result.items():
        if key == "error":
            out["valid"] = False
        out[key] = value
    out.setdefault("valid", False)
    return out
