"""Turning a `--model` spec into a local Hugging Face model directory.

A spec is, in this order: a short name from `packaged.MODEL_SOURCES` (None means the
default model); a model directory (config.json, weights, tokenizer); a `.gguf` file; a
hub id `org/name[@revision]` already in the local Hugging Face hub cache. A GGUF, from
any of them, resolves to its converted copy in the conversion cache.

Torch-free: a GGUF that is not converted yet imports torch to convert it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from aici_cli.core.errors import ModelError
from aici_cli.models.cache.conversions import cache_target, converted_gguf, slug
from aici_cli.models.sources import packaged
from aici_cli.models.sources.hub import hub_model
from aici_cli.models.sources.packaged import DEFAULT_MODEL, ModelSource, source_of_gguf

_ACCEPTED = ("expected a Hugging Face model directory, a .gguf file, a hub id cached locally "
             "(org/name), or a short name ('aici-batch models' lists them)")

# A Hugging Face hub id, `org/name`, optionally `@revision` (a branch, tag or commit).
# Names start with a letter or digit, so `./x/y`, `~/x/y` and `/x/y` stay paths.
_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")


def resolve_model(spec: str | None) -> Path:
    """Map a model spec to a local Hugging Face model directory, converting a GGUF if needed.

    In order: a short name from `MODEL_SOURCES` (None means `DEFAULT_MODEL`) -> its
    converted GGUF; a directory holding config.json -> itself; a `.gguf` file -> its
    converted, cached copy; `org/name[@revision]` -> its snapshot in the hub cache. The
    first use of a GGUF costs ~20 s; later calls only stat the file and the cache
    directory.
    """
    return resolve_with_name(spec)[0]


def resolve_with_name(spec: str | None) -> tuple[Path, str]:
    """(model directory, the name results report) for a model spec."""
    spec = DEFAULT_MODEL if spec is None else spec
    source = packaged.MODEL_SOURCES.get(spec)
    if source is not None:
        return _source_model(source), source.name
    path = Path(spec).expanduser()
    if path.is_dir():
        return _checked_dir(path, spec), _display_name(spec)
    if path.is_file() and path.suffix.lower() == ".gguf":
        owner = source_of_gguf(path)
        if owner is not None:
            return converted_gguf(path, owner.cache_prefix, owner.package), owner.name
        return converted_gguf(path, slug(path.stem)), _display_name(spec)
    if path.is_file():
        raise ModelError(f"model {spec!r} is a file but not a .gguf file: {_ACCEPTED}")
    hub_id = _HUB_ID.fullmatch(spec)
    if hub_id is not None:
        return hub_model(spec, hub_id["repo"], hub_id["revision"]), spec
    where = f"no file or directory {path.absolute()} exists"
    if not _looks_like_path(spec):
        where = f"not a known model name, and {where}"
    raise ModelError(f"model {spec!r} not found: {where}; {_ACCEPTED}")


def spec_problem(spec: str | None) -> str | None:
    """Why `spec` names no model at all (not found, a file that is not a .gguf, a
    directory without config.json), told without converting or loading anything, so a
    run can refuse it before its heavy imports; None where it may load. A short name
    and a .gguf file are judged when they load (their package, a conversion)."""
    if spec is None or spec in packaged.MODEL_SOURCES:
        return None
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return None
    try:
        resolve_with_name(spec)
    except ModelError as e:
        return str(e)
    return None


def _source_model(source: ModelSource) -> Path:
    """The model directory of a short name: its own directory, or its converted GGUF."""
    found = source.find()
    if found is not None and found.is_dir():
        return _checked_dir(found, source.name)
    if found is not None:
        converted = cache_target(found, source.cache_prefix, source.package)
        if (converted / "config.json").is_file():
            return converted  # no need to check or assemble the GGUF again
    path = source.provide()
    if path.is_dir():
        return _checked_dir(path, source.name)
    return converted_gguf(path, source.cache_prefix, source.package)


def _checked_dir(path: Path, spec: str) -> Path:
    if (path / "config.json").is_file():
        return path
    raise ModelError(
        f"model {spec!r} is a directory without config.json{_gguf_hint(path)}: {_ACCEPTED}"
    )


def _looks_like_path(spec: str) -> bool:
    """Whether the user evidently meant a path rather than a model name."""
    return (
        "/" in spec or os.sep in spec or spec.startswith(("~", ".")) or bool(Path(spec).suffix)
    )


def _gguf_hint(directory: Path) -> str:
    """` (it holds x.gguf: pass that file)` when a directory holds GGUF files."""
    try:
        ggufs = sorted(p.name for p in directory.glob("*.gguf") if p.is_file())
    except OSError:
        return ""
    if not ggufs:
        return ""
    return f" (it holds {ggufs[0]}: pass that file instead)"


def _display_name(spec: str | None) -> str:
    if spec is None or spec == DEFAULT_MODEL:
        return DEFAULT_MODEL
    path = Path(spec).expanduser()
    return path.name or str(path)
