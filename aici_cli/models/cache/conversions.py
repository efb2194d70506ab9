"""aici-batch's cache directory, and the GGUF conversions kept in it.

Loading a GGUF through transformers costs ~20 s (dequantisation), so a GGUF is converted
once into a directory under `cache_dir()/models/`: its config and tokenizer, and
`BASE_FILE`, the tensors no run quantises (norms, the embedding) with a record of where in
the GGUF each matrix lies (`tensors`). What a run needs beyond that is built from
the GGUF on its first use and kept beside it: a quantised run's layers in their kernels'
layout (`packed_layers`), an unquantised run's dense copy (`DENSE_FILE`,
`ensure_dense`); `entry_files` says which prune removes. Later loads of the directory
take ~1 s.

An entry is keyed by the GGUF's content (`gguf_identity`), so one copy serves every path
the same file has (each virtual environment's copy of a packaged model, each CI
checkout). The conversion writes into a temporary sibling directory and renames it into
place, so a cache directory that exists is always complete; a lock per key makes a
second run that needs the same conversion wait for the first and use its copy (without
locks, both convert and the first rename wins). A run killed mid-conversion leaves only
its hidden temporary directory, which later conversions remove once it is stale. Each
entry records what it holds and the files it was converted from (`SOURCE_FILE`);
`cache_entries` finds those nothing points to any more, for `aici-batch models --prune`.

Torch-free: the conversion itself (`convert`) is imported only on a cache miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from aici_cli.core.cache_paths import cache_dir
from aici_cli.core.errors import ModelError, one_line
from aici_cli.core.file_lock import exclusive_lock
from aici_cli.models.gguf.entry_record import (
    BASE_FILE,
    DENSE_FILE,
    digests_file,
    read_source,
    source_gguf,
    write_source,
)
from aici_cli.models.gguf.identity import GgufIdentity, gguf_identity
from aici_cli.models.progress import current_progress
from aici_cli.models.quiet import quiet_transformers

# Bump when the conversion's output changes, so existing cache entries are not reused.
_CONVERTER_VERSION = "4"  # 2: bfloat16, and the GGUF's own quantised blocks; 3: tensors
# at 64-byte boundaries of their files (`aligned`); 4: no dense copy of the GGUF's
# matrices, built per mode on first use

# A conversion's temporary directory untouched for this long belongs to a run that died:
# a live conversion writes its files within a minute for the default model (a few
# minutes for a multi-GB GGUF), so an hour leaves a wide margin.
STALE_TMP_SECONDS = 3600.0


def models_dir() -> Path:
    """Where converted models live: `cache_dir()/models`."""
    return cache_dir() / "models"


@contextlib.contextmanager
def entry_lock(key: str, on_wait: Callable[[], None] | None = None) -> Iterator[None]:
    """The lock of the entry with `key`: held while it is made, recorded or removed."""
    with exclusive_lock(cache_dir() / "locks", f"model-{key}", on_wait):
        yield


def converter_versions() -> tuple[str, str]:
    """(this converter's version, transformers' version): what an entry's key covers
    besides the GGUF's content. Read from its installed metadata: importing transformers
    costs ~0.45 s, which a run that finds its conversion should not pay."""
    from importlib.metadata import version

    return _CONVERTER_VERSION, version("transformers")


def _key(identity: GgufIdentity) -> str:
    """12 hex digits over the GGUF's content, the converter and the transformers version
    (both the tensors and the config layout come from transformers' GGUF mapping)."""
    source = "\0".join([*converter_versions(), identity.sha256])
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def _entry_with_key(key: str) -> Path | None:
    """The complete cache entry of `key`, whatever name it was made under (the same
    content given by another file name shares it)."""
    with contextlib.suppress(OSError):
        for entry in sorted(models_dir().glob(f"*-{key}")):
            if not entry.name.startswith(".") and (entry / "config.json").is_file():
                return entry
    return None


def cache_target(gguf: Path, name: str, package: str | None = None) -> Path:
    """Where the converted copy of `gguf` lives: `cache_dir()/models/<name>-<key>`, or the
    entry another name made for the same content.

    The key covers the file's content (see `gguf_identity`: `package`, the pip package
    the file may come from, lets its RECORD answer), so every virtual environment and
    checkout on a machine shares one copy. Cheap after the first time: a stat and a look
    at the remembered digests.
    """
    key = _key(gguf_identity(gguf, digests_file(), package))
    return _entry_with_key(key) or models_dir() / f"{name}-{key}"


def converted_gguf(gguf: Path, name: str, package: str | None = None) -> Path:
    """The cache directory holding `gguf` converted to safetensors, converting on a miss.

    One run converts while any other run that needs the same content waits for it (a
    lock per key), then uses its copy.
    """
    gguf = gguf.resolve()
    identity = gguf_identity(gguf, digests_file(), package)
    key = _key(identity)
    found = _entry_with_key(key)
    if found is not None:
        if not _is_recorded(found, gguf, identity):  # a new path to the same content
            with entry_lock(key):
                _remember_source(found, gguf, identity)
        return found
    target = models_dir() / f"{name}-{key}"
    progress = current_progress()
    with entry_lock(key, on_wait=lambda: progress.note(
            f"waiting for another run converting {gguf.name}")):
        found = _entry_with_key(key)  # the run we waited for made it
        if found is None:
            _convert(gguf, name, target, identity, package)
            found = target
        _remember_source(found, gguf, identity)
    return found


def _convert(gguf: Path, name: str, target: Path, identity: GgufIdentity,
             package: str | None) -> None:
    """Convert `gguf` into a temporary sibling of `target`, then rename it into place.
    `package`: the pip package that ships `gguf`, named in the remedy for a damaged one."""
    # Imports torch and transformers' model classes (seconds): a cache hit needs neither.
    from aici_cli.models.gguf import convert

    with convert.shared_reads():  # the file parsed once, for the check too
        _convert_checked(gguf, target, identity, package)


def _convert_checked(gguf: Path, target: Path, identity: GgufIdentity,
                     package: str | None) -> None:
    from aici_cli.models.gguf import convert

    # Before the temporary directory: a damaged file costs nothing to refuse.
    problem = convert.gguf_problem(gguf)
    if problem is not None:
        remedy = f" (reinstall the {package!r} package)" if package is not None else ""
        raise ModelError(f"cannot convert {gguf}: {problem}{remedy}")
    folder = target.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(folder)
        # A crash leaves this hidden directory behind; it is never mistaken for a model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp", dir=folder))
    except OSError as exc:
        raise ModelError(f"cannot write model cache {folder}: {one_line(exc)}") from exc
    try:
        with quiet_transformers():  # its warnings about GGUF metadata are not for users
            convert.convert_gguf(gguf, tmp)
        _remember_source(tmp, gguf, identity)  # installed with its record, never without
        _install(tmp, target)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot convert {gguf}: {one_line(exc)}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename


def _remember_source(entry: Path, gguf: Path, identity: GgufIdentity) -> None:
    """Add `gguf` to the files the entry's `SOURCE_FILE` says it was converted from
    (`prune` keeps an entry while one of them still holds its content). Written only when
    something is new, under the entry's lock; a cache that cannot be written is left as
    it is."""
    if _is_recorded(entry, gguf, identity):
        return
    old = read_source(entry) or {}
    files = [f for f in old.get("files", []) if isinstance(f, str)]
    converter, transformers_version = converter_versions()
    record = {"sha256": identity.sha256, "origin": identity.origin,
              "converter": converter, "transformers": transformers_version,
              "files": [*files, str(gguf)] if str(gguf) not in files else files}
    if "default_files" in old:  # `entry_files`' note, kept
        record["default_files"] = old["default_files"]
    write_source(entry, record)


def _is_recorded(entry: Path, gguf: Path, identity: GgufIdentity) -> bool:
    record = read_source(entry) or {}
    return record.get("sha256") == identity.sha256 and str(gguf) in record.get("files", [])


def entry_key(entry: Path) -> str:
    """The key an entry's directory name ends with (`<name>-<key>`)."""
    return entry.name.rsplit("-", 1)[-1]


def ensure_dense(entry: Path) -> None:
    """Make the entry's `DENSE_FILE` (every weight in bfloat16: what a run that quantises
    nothing maps) where a conversion of this version lacks it. Once per entry, on the
    first such run, under the entry's lock: another run that needs it waits and uses it."""
    if not (entry / BASE_FILE).is_file() or (entry / DENSE_FILE).is_file():
        return  # not such a conversion (a model directory, a stub), or already made
    progress = current_progress()
    with entry_lock(entry_key(entry), on_wait=lambda: progress.note(
            f"waiting for another run writing the unquantised copy of {entry.name}")):
        if (entry / DENSE_FILE).is_file():
            return
        gguf = source_gguf(entry)
        if gguf is None:
            raise ModelError(f"cannot load {entry} unquantised: none of the GGUF files it was "
                             "converted from still holds its content (run it from the .gguf "
                             "file, or delete the directory to convert again)")
        from aici_cli.models.gguf import (
            convert as convert,  # torch and transformers: on a miss only
        )

        progress.note(f"writing the unquantised copy of {gguf.name} in {entry} (once, for "
                      "runs that quantise nothing)")
        try:
            with quiet_transformers():
                convert.write_dense(gguf, entry / DENSE_FILE)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"cannot convert {gguf}: {one_line(exc)}") from exc


def _install(tmp: Path, target: Path) -> None:
    """Rename the finished conversion `tmp` into place as `target`.

    The rename is atomic: `target` is either absent or complete. A `target` without
    config.json was not made here (renames only install complete copies): it is moved
    aside and removed, or it would block every later conversion.
    """
    if target.exists() and not (target / "config.json").is_file():
        aside = Path(tempfile.mkdtemp(prefix=f".{target.name}-", suffix=".tmp",
                                      dir=target.parent))
        # Failing means a concurrent run replaced it first; the rename below decides.
        with contextlib.suppress(OSError):
            target.rename(aside / "old")
        shutil.rmtree(aside, ignore_errors=True)
    try:
        tmp.rename(target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
        # A concurrent run finished first; its copy is equivalent.


def _remove_stale_tmp(folder: Path) -> None:
    """Remove temporary conversion directories left by runs that died mid-conversion.

    Only those untouched for `STALE_TMP_SECONDS`: a younger one may be a concurrent
    run's conversion in progress. They are never read as models (hidden, `.tmp`), so this
    only reclaims disk space.
    """
    cutoff = time.time() - STALE_TMP_SECONDS
    for entry in folder.glob(".*.tmp"):
        try:
            if entry.is_dir() and entry.stat().st_mtime < cutoff:
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:
            continue  # removed by another run meanwhile


def cache_hint(path: Path) -> str:
    """`; delete it to convert again` for a damaged conversion in the cache.

    Renames install only complete conversions, so damage there came later (a full disk,
    a hand edit); the user may not know the directory is disposable.
    """
    try:
        cached = path.resolve().parent == (cache_dir() / "models").resolve()
    except OSError:
        return ""
    return f"; delete {path} to convert the model again" if cached else ""


def slug(text: str) -> str:
    """A lowercase cache-directory-safe rendering of a model file name."""
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"
