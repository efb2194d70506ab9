"""An exception as the one line a user reads: its type, then the first line of its text.

Library errors (transformers, huggingface_hub, jinja, numpy) often span many lines or say
nothing at all; the CLI prints every fatal error as one line.
"""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """`TypeName: first line of the message`, or just `TypeName` when the message is empty."""
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__
