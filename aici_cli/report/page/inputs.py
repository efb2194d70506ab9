"""`aici-batch report --input INPUT.jsonl`: the run's input lines, for what results do not
hold: the prompt or messages a line asked with, and the JSON Schema or tools its output
was checked against (the page shows the one, and explains the other's verdict with it).

A result names its input line by `index` (the physical line number) and `input_sha256`
(a digest of that line's bytes, `aici_cli.run.resume.line_digest`); an input line is
paired with a result only when both agree, so an input edited since the run shows as
such instead of lending a result another line's prompt. Both formats are read: the
tool's own lines and OpenAI batch requests (mapped as `run` maps them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aici_cli.control.schema_envelope import unwrap as unwrap_envelope
from aici_cli.core.errors import ReportError
from aici_cli.core.job import TranslateError
from aici_cli.formats.openai_batch import looks_like_request, to_line
from aici_cli.run.resume import line_digest

#: The input fields the page shows with a line (the rest already shape the result).
SHOWN = ("prompt", "messages", "tools", "json_schema", "regex", "choices", "grammar")


@dataclass(frozen=True)
class InputLine:
    digest: str
    fields: dict[str, Any]  # SHOWN's fields the line has

    @property
    def schema(self) -> Any:
        """The JSON Schema its output was checked against, or None."""
        if "json_schema" not in self.fields:
            return None
        schema, _ = unwrap_envelope(self.fields["json_schema"])
        return schema

    def tool_schemas(self) -> dict[str, Any]:
        """Each tool's name -> its `parameters` schema (what a call's arguments must be)."""
        out: dict[str, Any] = {}
        for tool in self.fields.get("tools") or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                out[function["name"]] = function.get("parameters", {})
        return out


def _fields(raw: bytes) -> dict[str, Any]:
    """The shown fields of one input line; {} for a line that is not a JSON object (the
    run answered it with an error, which the result already says)."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return {}
    if looks_like_request(obj):
        try:
            obj, _ = to_line(obj)
        except TranslateError:  # the run answered it with an error result
            return {}
    if not isinstance(obj, dict):
        return {}
    return {key: obj[key] for key in SHOWN if key in obj}


def read_inputs(path: str | Path) -> dict[int, InputLine]:
    """Every non-blank input line by its 1-based physical line number."""
    path = Path(path)
    out: dict[int, InputLine] = {}
    try:
        with path.open("rb") as fh:
            for n, raw in enumerate(fh, start=1):
                if raw.strip():
                    out[n] = InputLine(line_digest(raw), _fields(raw))
    except OSError as e:
        raise ReportError(f"--input {path}: cannot read it: {e.strerror or e}") from None
    return out


def input_of(result: dict[str, Any], inputs: dict[int, InputLine] | None
             ) -> tuple[InputLine | None, str | None]:
    """The input line of `result`, or None and why there is none to show."""
    if inputs is None:
        return None, "the prompt is in the input file: report with --input INPUT.jsonl"
    line = inputs.get(int(result.get("index", 0)))
    if line is None:
        return None, "the input file has no such line"
    digest = result.get("input_sha256")
    if digest is not None and digest != line.digest:
        return None, "the input line changed since the run (its digest differs)"
    return line, None
