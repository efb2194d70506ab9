"""Why an output is not valid: every error jsonschema finds in it, with its JSON path.

Asked only about outputs the run marked invalid (`valid: false`): searching for errors
costs far more than a yes/no check, and a valid output has none to show. A validator is
built once per distinct schema (an eval's lines usually share one), with an empty
registry, as the run builds its own: a `$ref` to a URL is never fetched.
"""

from __future__ import annotations

import functools
import json
import warnings
from typing import Any

import referencing
from jsonschema.exceptions import ValidationError, relevance
from jsonschema.validators import validator_for

MAX_ERRORS = 20  # a page is read by people: the first few say what went wrong


@functools.lru_cache(maxsize=256)
def _validator(schema_text: str) -> Any:
    schema = json.loads(schema_text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unknown $schema or a `pattern`'s FutureWarning
        return validator_for(schema)(schema, registry=referencing.Registry())


def _as_dict(error: ValidationError) -> dict[str, str]:
    return {"path": error.json_path, "message": error.message,
            "keyword": str(error.validator),
            "schema_path": "/".join(str(p) for p in error.absolute_schema_path)}


def schema_errors(schema: Any, value: Any) -> list[dict[str, str]]:
    """`value`'s errors under `schema`, most relevant first (jsonschema's `relevance`,
    the order of `best_match`), each as {path, message, keyword, schema_path}; [] when
    it validates or cannot be checked."""
    try:
        validator = _validator(json.dumps(schema, sort_keys=True))
        found = sorted(validator.iter_errors(value), key=relevance)
    except Exception:  # noqa: BLE001 - a schema jsonschema cannot use: nothing to show
        return []
    return [_as_dict(e) for e in found[:MAX_ERRORS]]


def output_errors(text: str, has_json: bool, value: Any, schema: Any) -> list[dict[str, str]]:
    """The errors of an output whose JSON is `value` (`has_json`), or of its `text` when
    no JSON came: a text that does not parse is one error at the top level."""
    if has_json:
        return schema_errors(schema, value)
    try:
        parsed = json.loads(text)
    except ValueError as e:
        return [{"path": "$", "message": f"the output is not JSON: {e}", "keyword": "json",
                 "schema_path": ""}]
    return schema_errors(schema, parsed)


def call_errors(calls: list[dict[str, Any]], tools: dict[str, Any]) -> list[dict[str, str]]:
    """The errors of tool calls' arguments under their tools' `parameters`, each path
    led by the call (`calls[0].arguments`)."""
    out: list[dict[str, str]] = []
    for i, call in enumerate(calls):
        function = call.get("function") or {}
        where = f"calls[{i}]"
        name = function.get("name")
        if name not in tools:
            out.append({"path": f"{where}.function.name", "keyword": "tools",
                        "message": f"{name!r} is not one of the line's tools",
                        "schema_path": ""})
            continue
        for error in output_errors(str(function.get("arguments", "")), False, None,
                                   tools[name]):
            out.append({**error, "path": f"{where}.arguments{error['path'][1:]}"})
    return out
