"""Pulled artifacts in the component cache, keyed by digest, so later runs need no network.

Beside the compiled components (`control/wasm/compile_cache.py`, `components/`), under
`cache_dir()/oci/`:
- `blobs/sha256/<hex>`: blobs (the component, its config) by their content digest;
- `manifests/sha256/<hex>`: manifests by their digest, the bytes the registry served;
- `tags/<registry>/<repository>/<tag>`: the digest a tag resolved to last (only to say,
  when the registry is unreachable, which digest would run offline).

Every entry is written by an atomic rename and checked against its digest when read: a
damaged entry counts as missing (it is fetched again). Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

from aici_cli.control.registry.refs import OciRef
from aici_cli.core.cache_paths import cache_dir


def oci_cache_dir() -> Path:
    return cache_dir() / "oci"


def _hex(digest: str) -> str:
    return digest.split(":", 1)[1]


def file_digest(path: Path) -> str:
    """sha256 of a file (about 20 ms for an 18 MB component)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


class ArtifactStore:
    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else oci_cache_dir()

    @property
    def incoming(self) -> Path:
        """Where downloads land before they are checked and moved into place."""
        return self.root / "blobs" / "sha256"

    def blob_path(self, digest: str) -> Path:
        return self.root / "blobs" / "sha256" / _hex(digest)

    def blob(self, digest: str) -> Path | None:
        """The blob's file, if present and intact."""
        path = self.blob_path(digest)
        if not path.is_file():
            return None
        if file_digest(path) != digest:
            with contextlib.suppress(OSError):
                path.unlink()  # damaged: fetched again
            return None
        return path

    def add_blob(self, digest: str, downloaded: Path) -> Path:
        """Move a checked download into place."""
        path = self.blob_path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.replace(downloaded, path)
        return path

    def manifest(self, digest: str) -> bytes | None:
        path = self.root / "manifests" / "sha256" / _hex(digest)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
            return None
        return raw

    def add_manifest(self, digest: str, raw: bytes) -> None:
        self._write(self.root / "manifests" / "sha256" / _hex(digest), raw)

    def remember_tag(self, ref: OciRef, digest: str) -> None:
        if ref.tag is not None:
            self._write(self._tag_path(ref), digest.encode())

    def last_digest(self, ref: OciRef) -> str | None:
        """The digest `ref`'s tag resolved to last on this machine, if any."""
        if ref.tag is None:
            return None
        try:
            return self._tag_path(ref).read_text().strip() or None
        except OSError:
            return None

    def _tag_path(self, ref: OciRef) -> Path:
        assert ref.tag is not None
        host = ref.registry.replace(":", "_")
        return self.root / "tags" / host / ref.repository / ref.tag

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
