"""`aici-batch doctor --cache-key`: the key under which a CI job keeps the cache folder.

A CI job restores `cache_dir()` before its run and saves it after (examples/ci), under
a key that changes exactly when what the folder holds would not serve the next job: the
CPU (`CpuFeatures.fingerprint`: model name and instruction-set flags; the compiled
steps and kernels are built for it), the versions of aici-batch and torch (the steps'
code and packages), and the model's content (the conversion). Whatever the key, a folder
another CPU made is never used (models/cache/machine.py): a restore by a partial key
rebuilds those parts.

The model is hashed without loading or converting it: a GGUF by its content digest
(`gguf/identity.py`: from its wheel's RECORD or remembered, else read once), a model
directory by every file's bytes (about 0.3 s per 100 MB).
"""

from __future__ import annotations

import hashlib
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from aici_cli import __version__
from aici_cli.core.errors import ModelError
from aici_cli.models.gguf.entry_record import digests_file
from aici_cli.models.gguf.identity import gguf_identity
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.sources import packaged
from aici_cli.models.sources.resolve import resolve_with_name

_CHUNK = 1 << 20


def cache_key(spec: str | None) -> str:
    """The cache folder's key for runs of the model `spec` (None: the default model) on
    this machine: readable versions, then a digest of the machine, the versions and the
    model (`aici-batch-0.1.0-torch2.13.0-<16 hex>`)."""
    torch_version = _version("torch")
    parts = {"machine": cpu_features().fingerprint, "aici-batch": __version__,
             "torch": torch_version, "model": model_digest(spec)}
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
    return f"aici-batch-{__version__}-torch{torch_version}-{digest[:16]}"


def model_digest(spec: str | None) -> str:
    """The sha256 of the model's content: its GGUF's, or its directory's files'."""
    spec = packaged.DEFAULT_MODEL if spec is None else spec
    source = packaged.MODEL_SOURCES.get(spec)
    if source is not None:
        found = source.find() or source.provide()
        return _digest(found, source.package)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _digest(path, None)
    if path.is_dir():
        return _digest(path, None)
    return _digest(resolve_with_name(spec)[0], None)  # a hub id: its local snapshot


def _digest(path: Path, package: str | None) -> str:
    if path.is_file():
        return gguf_identity(path, digests_file(), package).sha256
    total = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file())
    if not files:
        raise ModelError(f"model directory {path} holds no files")
    for file in files:
        total.update(f"{file.relative_to(path).as_posix()}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(_CHUNK):
                total.update(chunk)
    return total.hexdigest()


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "none"
