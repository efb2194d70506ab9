"""Compiling a component, through a cache of serialized (native) components on disk.

Compiling an 18 MB componentize-py component takes 6-18 s (2-core CPU, wasmtime 50) and
serializes to ~40 MB; loading it back from the cache takes 20-40 ms.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path

import wasmtime
from wasmtime.component import Component

from aici_cli.core.cache_paths import cache_dir
from aici_cli.core.file_lock import exclusive_lock


def default_cache_dir() -> Path:
    return cache_dir()


def compile_component(
    wasm_engine: wasmtime.Engine, wasm: bytes, fingerprint: str, cache_dir: Path
) -> tuple[Component, bool, Path | None]:
    """Compiles `wasm`, through `cache_dir/components/<key>.cwasm`.

    Returns (component, cache_hit, cache_file). The key is the sha256 of the wasm bytes
    and the wasm engine's fingerprint (wasmtime version, config, target). A cache file that
    fails to deserialize (truncated, other wasmtime) is recompiled and replaced. Writes
    are atomic (temp file + rename) so concurrent loads never see half a file; a cache
    that cannot be written is skipped silently. The cache holds native code: it must
    live in a directory only the user can write (the default is the user's cache dir).
    """
    key = hashlib.sha256(wasm + b"\0" + fingerprint.encode()).hexdigest()
    folder = cache_dir / "components"
    path = folder / f"{key}.cwasm"
    cached = _deserialize(wasm_engine, path)
    if cached is not None:
        return cached, True, path
    # Processes of one machine (the workers of a Ray node) compile a component once: the
    # first takes the lock and compiles, the others wait for it and load its file.
    with exclusive_lock(folder, key[:16]):
        cached = _deserialize(wasm_engine, path)
        if cached is not None:
            return cached, True, path
        return _compile_and_store(wasm_engine, wasm, folder, key, path)


def _deserialize(wasm_engine: wasmtime.Engine, path: Path) -> Component | None:
    if not path.is_file():
        return None
    try:
        return Component.deserialize_file(wasm_engine, str(path))
    except wasmtime.WasmtimeError:
        return None  # stale or damaged: recompiled and overwritten


def _compile_and_store(wasm_engine: wasmtime.Engine, wasm: bytes, folder: Path, key: str,
                       path: Path) -> tuple[Component, bool, Path | None]:
    component = Component(wasm_engine, wasm)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(component.serialize())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except (OSError, wasmtime.WasmtimeError):
        return component, False, None
    return component, False, path
