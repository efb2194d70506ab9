"""The page's data, held once: JSON, gzip-compressed and base64-encoded when that makes
the page smaller, which the browser unpacks with its own `DecompressionStream`.

Results compress well (the same keys on every line, an eval's shared prompt prefix), so
a big run's page is a fraction of its results file; a small run's JSON goes in as it is,
readable in the page's source. Either way it sits in a `<script type="application/json">`
element, which the browser never runs but whose end it looks for: every `<` of the JSON
(only ever inside a string) is written `\\u003c`, so no text a model wrote (`</script>`,
`<!--<script>`) can end the element early or keep it from ending.
"""

from __future__ import annotations

import base64
import gzip
import json
import math
import re
from typing import Any

COMPRESS_FROM = 16_384  # bytes of JSON: below this, base64's third more is not won back
_ELEMENT = re.compile(r'<script id="aici-data" type="application/json" '
                      r'data-encoding="([\w+]+)">(.*?)</script>', re.S)


def _finite(value: Any) -> Any:
    """`value` with NaN and the infinities as text: Python reads and writes them in JSON,
    a browser's JSON.parse refuses the whole document."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _json(data: dict[str, Any]) -> str:
    """Compact JSON, in ASCII: a lone surrogate a model wrote (valid in JSON's escapes,
    not in UTF-8) stays an escape instead of breaking the page's encoding."""
    try:
        return json.dumps(data, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a NaN somewhere: rare enough to walk the data only then
        return json.dumps(_finite(data), separators=(",", ":"))


def encode(data: dict[str, Any]) -> tuple[str, str]:
    """(encoding, text): "gzip+base64" or "json", and the element's text."""
    text = _json(data)
    raw = text.encode("utf-8")
    if len(raw) >= COMPRESS_FROM:
        # mtime=0: the same report gives the same page, byte for byte.
        packed = base64.b64encode(gzip.compress(raw, compresslevel=6, mtime=0)).decode("ascii")
        if len(packed) < len(raw):
            return "gzip+base64", packed
    return "json", text.replace("<", "\\u003c")


def element(data: dict[str, Any]) -> str:
    encoding, text = encode(data)
    return (f'<script id="aici-data" type="application/json" data-encoding="{encoding}">'
            f"{text}</script>")


def decode(page: str) -> dict[str, Any]:
    """The data of a written page (what the browser unpacks); ValueError without any."""
    match = _ELEMENT.search(page)
    if match is None:
        raise ValueError("no aici-batch report data in this page")
    encoding, text = match.groups()
    if encoding == "gzip+base64":
        text = gzip.decompress(base64.b64decode(text)).decode("utf-8")
    value: dict[str, Any] = json.loads(text)
    return value
