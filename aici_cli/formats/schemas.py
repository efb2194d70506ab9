"""The tool's own line formats: the JSON Schemas in `schemas/` and one cached validator
for each, shared by everything that checks a line against them (input lines, result
lines, run summaries, OpenAI batch output).

Torch-free: the CLI and `report` import it at startup.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

_SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"  # the checkout's schemas/


def _schema_filename(name: str) -> str:
    """Accept both "input-line" and "input-line.schema.json" so callers need not care."""
    return name if name.endswith(".json") else f"{name}.schema.json"


@functools.cache
def load_schema(name: str) -> dict[str, Any]:
    """Load a schema by name ("input-line", "result-line", "stats").

    The canonical files live in `schemas/` at the repo root so they are easy to find
    and publish; an installed package has no repo root, so fall back to the copies
    shipped as package data under `aici_cli/schemas`. The result is cached and shared:
    do not mutate it.
    """
    filename = _schema_filename(name)
    if _SCHEMA_DIR.is_dir():
        text = (_SCHEMA_DIR / filename).read_text(encoding="utf-8")
    else:
        resource = importlib.resources.files("aici_cli").joinpath("schemas", filename)
        text = resource.read_text(encoding="utf-8")
    schema: dict[str, Any] = json.loads(text)
    return schema


@functools.cache
def schema_validator(name: str) -> Draft202012Validator:
    """The validator for schema `name`, built once: construction walks the schema,
    checking a line does not."""
    return Draft202012Validator(load_schema(name))
