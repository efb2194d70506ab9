"""`--format`: which input format a run reads, aici-batch's own lines or OpenAI batch
requests; with `--format auto` the first line shaped like either decides.

Detection reads ahead of the run, and the lines it read must still reach it: they are
returned, at most `DETECT_LINES` lines and `DETECT_BYTES` bytes of them, so a 10 GB
input that decides late still streams rather than sitting in memory. Torch-free.
"""

from __future__ import annotations

import json
from typing import BinaryIO

from aici_cli.formats.openai_batch import line_format

# How far `--format auto` reads for a line that decides the format: lines (not counting
# blank ones) and bytes, since the lines read are held until the run sees them.
DETECT_LINES = 1000
DETECT_BYTES = 64 * 1024 * 1024


def detect_format(source: BinaryIO, wanted: str) -> tuple[list[bytes], str, str]:
    """The input format, and why (for the error of a line in the other one): `wanted`,
    or for "auto" that of the first line shaped like either (an OpenAI batch request,
    with any of custom_id/method/url/body, or a line with a field of aici-batch's own),
    skipping lines that are neither (invalid JSON, `{}`). Returns the lines read to
    decide, which the run must still see."""
    if wanted != "auto":
        return [], wanted, f"--format {wanted}"
    peeked: list[bytes] = []
    size = 0
    for raw in source:
        peeked.append(raw)
        size += len(raw)
        if raw.strip():
            decided = _line_format(raw)
            if decided is not None:
                return peeked, decided, f"--format auto, decided by line {len(peeked)}"
        if len(peeked) >= DETECT_LINES or size >= DETECT_BYTES:
            break
    return peeked, "aici", f"--format auto: no line in the first {len(peeked)} decided"


def _line_format(raw: bytes) -> str | None:
    try:
        obj = json.loads(raw.decode("utf-8").removeprefix("\ufeff"))
    except (ValueError, RecursionError):  # bad UTF-8 or JSON: this line's own error later
        return None
    return line_format(obj)
