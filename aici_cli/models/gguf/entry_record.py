"""A conversion-cache entry's own files: the names of what it holds, and its record of the
GGUF content it was converted from (`SOURCE_FILE`).

A leaf of the conversion cache (`conversions` makes entries, the modules that read
and build their files ask this one), torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models.gguf.identity import still_holds

# A conversion's tensors that no run quantises, and where the GGUF holds each matrix.
BASE_FILE = "aici-base.safetensors"
# Every weight in bfloat16, for runs that quantise nothing; made on a conversion's first
# such run (`conversions.ensure_dense`), under the name transformers' loader reads.
DENSE_FILE = "model.safetensors"

# Each entry's record of the GGUF content it holds and the files it was converted from.
SOURCE_FILE = "aici-batch-source.json"


def digests_file() -> Path:
    """The remembered GGUF digests (`gguf_identity`); beside `models/`, which holds
    entries only."""
    return cache_dir() / "gguf-digests.json"


def read_source(entry: Path) -> dict[str, Any] | None:
    """An entry's record of what it was converted from, or None (an entry made before
    conversions were keyed by content has none)."""
    try:
        value = json.loads((entry / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_source(entry: Path, record: dict[str, Any]) -> None:
    """Replace the entry's `SOURCE_FILE` atomically (the caller holds the entry's lock);
    a cache that cannot be written is left as it is."""
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=entry, prefix=".source-", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, entry / SOURCE_FILE)


def source_gguf(entry: Path) -> Path | None:
    """A GGUF file the entry was converted from that still holds its content, or None (a
    directory that is not a conversion, or whose files are all gone or changed). What a
    mode builds on its first use is read from it."""
    record = read_source(entry) or {}
    sha256 = record.get("sha256")
    if not isinstance(sha256, str):
        return None
    for name in record.get("files", []):
        if isinstance(name, str) and still_holds(Path(name), digests_file(), sha256):
            return Path(name)
    return None
