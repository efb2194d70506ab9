"""aici-batch's cache directory, and the GGUF conversions kept in it.

Loading a GGUF through transformers costs ~20 s (dequantisation), so a GGUF is converted
once into a float32 safetensors directory under `cache_dir()/models/`; later loads of that
directory take ~1 s. The conversion writes into a temporary sibling directory and renames
it into place, so a cache directory that exists is always complete, and concurrent runs
at worst convert twice rather than corrupt each other. A run killed mid-conversion leaves
only its hidden temporary directory, which later conversions remove once it is stale.

Torch-free: the conversion itself (`gguf_convert`) is imported only on a cache miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

from aici_cli.errors import ModelError
from aici_cli.models import sources
from aici_cli.models.one_line import one_line
from aici_cli.models.quiet import quiet_transformers

# Bump when the conversion's output changes, so existing cache entries are not reused.
_CONVERTER_VERSION = "1"

# A conversion's temporary directory untouched for this long belongs to a run that died:
# a live conversion writes its files within a minute for the default model (a few
# minutes for a multi-GB GGUF), so an hour leaves a wide margin.
_STALE_TMP_SECONDS = 3600.0


def cache_dir() -> Path:
    """`$AICI_BATCH_CACHE`, else `$XDG_CACHE_HOME/aici-batch`, else `~/.cache/aici-batch`.

    Not created here; callers that write create what they need.
    """
    explicit = os.environ.get("AICI_BATCH_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "aici-batch"
    return Path.home() / ".cache" / "aici-batch"


def cache_target(gguf: Path, name: str) -> Path:
    """Where the converted copy of `gguf` lives: `cache_dir()/models/<name>-<12 hex>`.

    The key covers the file's identity (resolved path, size, mtime) and the transformers
    version, since both the tensors and the config layout come from transformers' GGUF
    mapping. Only a stat, so cheap enough for every resolve (importing transformers for
    its version does not import torch).
    """
    import transformers

    gguf = gguf.resolve()
    stat = gguf.stat()
    key_source = "\0".join(
        [
            _CONVERTER_VERSION,
            str(gguf),
            str(stat.st_size),
            str(stat.st_mtime_ns),
            transformers.__version__,
        ]
    )
    digest = hashlib.sha256(key_source.encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"{name}-{digest}"


def converted_gguf(gguf: Path, name: str) -> Path:
    """The cache directory holding `gguf` converted to safetensors, converting on a miss."""
    gguf = gguf.resolve()
    target = cache_target(gguf, name)
    models_dir = target.parent
    if (target / "config.json").is_file():
        return target

    # Imports torch and transformers' model classes (seconds): a cache hit needs neither.
    from aici_cli.models import gguf_convert

    # Before the temporary directory: a damaged file costs nothing to refuse.
    problem = gguf_convert.gguf_problem(gguf)
    if problem is not None:
        owner = next((s for s in sources.MODEL_SOURCES.values() if s.cache_prefix == name),
                     None)
        remedy = f" (reinstall the {owner.package!r} package)" if owner is not None else ""
        raise ModelError(f"cannot convert {gguf}: {problem}{remedy}")
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_tmp(models_dir)
        # A crash leaves this hidden directory behind; it is never mistaken for a model.
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", suffix=".tmp", dir=models_dir))
    except OSError as exc:
        raise ModelError(f"cannot write model cache {models_dir}: {one_line(exc)}") from exc
    try:
        with quiet_transformers():  # its warnings about GGUF metadata are not for users
            gguf_convert.convert_gguf(gguf, tmp)
        _install(tmp, target)
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"cannot convert {gguf}: {one_line(exc)}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op after a successful rename
    return target


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


def _remove_stale_tmp(models_dir: Path) -> None:
    """Remove temporary conversion directories left by runs that died mid-conversion.

    Only those untouched for `_STALE_TMP_SECONDS`: a younger one may be a concurrent
    run's conversion in progress. They are never read as models (hidden, `.tmp`), so this
    only reclaims disk space.
    """
    cutoff = time.time() - _STALE_TMP_SECONDS
    for entry in models_dir.glob(".*.tmp"):
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
