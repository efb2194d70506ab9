"""The values of `run`'s constraint options as users write them: `--choices` as a
comma list or a JSON array, `--json-schema FILE` (OpenAI's envelope unwrapped, a schema
that constrains nothing refused), `--grammar FILE` (Lark or GBNF).

Each raises a one-line `UsageError` naming the option; the CLI turns it into exit 2.
Torch-free (`--grammar` imports llguidance, not torch).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aici_cli.control.schema_envelope import inert_problem, unwrap
from aici_cli.core.errors import UsageError


def choices_option(text: str) -> list[str]:
    """`--choices`: a JSON array of strings (`'["a, b", "c"]'`, for a choice with a comma
    or with spaces of its own), or comma-separated choices with the spaces around each
    comma trimmed (`'positive, negative'`). Empty and duplicate choices are refused."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            options = json.loads(stripped)
        except ValueError as e:
            raise UsageError(f"--choices looks like a JSON array but is not JSON: {e}") from None
        if not isinstance(options, list) or not all(isinstance(o, str) for o in options):
            raise UsageError("--choices as a JSON array must hold strings only")
    else:
        options = [c.strip() for c in text.split(",")]
        options = [c for c in options if c]
    if not options or not all(options):
        raise UsageError("--choices needs at least one non-empty choice")
    seen: set[str] = set()
    for option in options:
        if option in seen:
            raise UsageError(f"--choices gives {option!r} twice: each choice must differ")
        seen.add(option)
    return options


def schema_option(path: str) -> tuple[dict[str, Any] | bool, str | None]:
    """`--json-schema FILE`: the schema, and a note when it was taken out of OpenAI's
    envelope (for stderr). A schema whose top level constrains nothing is refused."""
    try:
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read --json-schema {path}: {e.strerror}") from None
    except ValueError as e:
        raise UsageError(f"--json-schema {path} is not JSON: {e}") from None
    except RecursionError:
        raise UsageError(f"--json-schema {path} is nested too deeply") from None
    if not isinstance(schema, (dict, bool)):
        raise UsageError(f"--json-schema {path} must hold a JSON object")
    schema, unwrapped = unwrap(schema)
    note = f"--json-schema {path} {unwrapped}" if unwrapped is not None else None
    if not isinstance(schema, (dict, bool)):  # an envelope's `schema` checked by unwrap
        raise UsageError(f"--json-schema {path} must hold a JSON object")
    problem = inert_problem(schema)
    if problem is not None:
        raise UsageError(f"--json-schema {path} {problem}")
    return schema, note


def grammar_option(path: str) -> str:
    """`--grammar FILE`: the grammar as Lark (a GBNF file, llama.cpp's, converted as a
    line's `grammar` is), refused when llguidance cannot use it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read --grammar {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--grammar {path} is not UTF-8 text: {e.reason}") from None
    from aici_cli.control.grammar_check import lark_grammar

    lark, why = lark_grammar(text)
    if why is not None:
        raise UsageError(f"--grammar {path} is not a usable grammar: {why}")
    return lark
