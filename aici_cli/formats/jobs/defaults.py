"""The run's own line defaults (`--json-schema`, `--regex`, `--choices`, `--stop`,
`--max-tokens`, `--temperature`, ...), checked once before anything loads.

A default is an option, not a line: a bad one would fail every line that does not
override it alike, each with its own error result, after the model loaded. So it is
checked as a line that carries it would be (the same checks, the same limits), and
then, for a constraint, whether the grammar engine can enforce it at all; the first
problem becomes a one-line usage error naming the option. A line's own fields stay
per-line errors.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from aici_cli.core.config import FIELD_OPTIONS, JobDefaults
from aici_cli.core.constraint import Constraint
from aici_cli.core.job import BadLine
from aici_cli.formats.jobs.parse import read_jobs

# A line field -> the run option that sets its default.
OPTIONS = {**FIELD_OPTIONS, "top_logprobs": "--logprobs"}
# The line field of each constraint kind a run option can set.
_FIELDS = {"json_schema": "json_schema", "regex": "regex", "choice": "choices"}
_FIELD = re.compile(r"field '(\w+)((?:\[\d+\])*)'")


def defaults_problem(defaults: JobDefaults, strict_json: bool,
                     schema_file: str | None = None) -> str | None:
    """Why the run's defaults cannot be used, as one line naming the option, or None.

    `schema_file` is the `--json-schema` file, named in the message. A JSON schema the
    grammar engine refuses (but not one too large to compile) is left to the lines under
    `--schema-fallback relax`, which generates with the closest schema it can enforce.
    """
    line = json.dumps(_as_line(defaults))
    item = next(read_jobs([line], dataclasses.replace(defaults, constraint=None)), None)
    shown = {**OPTIONS, "json_schema": f"--json-schema {schema_file or ''}".rstrip()}
    if isinstance(item, BadLine):
        problem = item.message.split(": ", 1)[1]  # after "line 1: "
        problem = problem.replace("at most max_tokens", "at most --max-tokens")
        return _FIELD.sub(lambda m: _option(m, shown), problem)
    constraint = defaults.constraint
    if constraint is None or constraint.kind not in _FIELDS:
        return None
    from aici_cli.control.grammar.limits import schema_shape_problem
    from aici_cli.control.grammar_check import support_problem

    if constraint.kind == "json_schema":
        too_large = schema_shape_problem(constraint.value)  # relaxing makes it no smaller
        if too_large is not None:
            return f"{shown['json_schema']}: {too_large}"
        if defaults.schema_fallback == "relax":
            return None

    unsupported = support_problem(constraint, strict_json)
    if unsupported is None:
        return None
    hint = (" (--schema-fallback relax generates with the closest schema it can enforce)"
            if constraint.kind == "json_schema" else "")
    return f"{shown[_FIELDS[constraint.kind]]}: {unsupported}{hint}"


def _as_line(defaults: JobDefaults) -> dict[str, Any]:
    """An input line that sets every field the run's options give a default for."""
    line: dict[str, Any] = {
        "prompt": "-", "max_tokens": defaults.max_tokens, **defaults.sampling.run_values(),
        "ignore_eos": defaults.ignore_eos, "n": defaults.n,
        "schema_fallback": defaults.schema_fallback,
    }
    if defaults.stop:
        line["stop"] = list(defaults.stop)
    if defaults.logprobs is not None:
        line.update(logprobs=True, top_logprobs=defaults.logprobs)
    constraint: Constraint | None = defaults.constraint
    if constraint is not None and constraint.kind in _FIELDS:
        line[_FIELDS[constraint.kind]] = constraint.value
        if defaults.score and constraint.kind == "choice":
            line.update(score=True, n=1)  # a scored line ranks once; its `n` is moot
    elif constraint is None and defaults.score:
        # `--score` alone ranks the choices each line brings: check it with a stand-in pair.
        line["choices"] = ["a", "b"]
    return line


def _option(match: re.Match[str], shown: dict[str, str]) -> str:
    name, index = match[1], match[2]
    option = shown.get(name, f"'{name}'")
    if index:  # stop[1]: the second --stop
        option += f" #{int(index.strip('[]').split('][')[0]) + 1}"
    return option
