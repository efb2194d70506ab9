"""How a JSON value, its type or a place in it is written inside a one-line message.

Shared by the input-line checks and the JSON Schema check, so a value or a field reads
the same in every message.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

_JSON_TYPE_NAMES: dict[type, str] = {
    dict: "object",
    list: "array",
    str: "string",
    bool: "boolean",
    int: "integer",
    float: "number",
    type(None): "null",
}


def json_type(value: Any) -> str:
    """Name a value's type the way the user wrote it (JSON), not the Python way."""
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def show(value: Any, limit: int = 60) -> str:
    """Render an offending value compactly, as JSON, truncated so messages stay one line."""
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_path(path: Sequence[str | int]) -> str:
    """`['messages', 0, 'role']` -> `messages[0].role`: how a user would name the spot."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out
