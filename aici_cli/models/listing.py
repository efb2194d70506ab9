"""Every model `--model` can name on this machine: the data of `aici-batch models`.

Torch-free: listing reads package metadata and directories, and imports transformers only
for its version (the conversion cache's key), which does not import torch.
"""

from __future__ import annotations

import contextlib
from typing import Any

from aici_cli.errors import ModelError
from aici_cli.models import sources
from aici_cli.models.conversion_cache import cache_dir, cache_target
from aici_cli.models.hub import hub_cache_dir, hub_models
from aici_cli.models.sources import DEFAULT_MODEL


def available_models() -> dict[str, Any]:
    """Every model `--model` can name on this machine, for `aici-batch models`.

    Nothing is converted, assembled or downloaded: short names report whether their
    package is installed and whether a converted copy is cached; then the conversion
    cache's entries (each with the short name it serves, if any: the others are older
    conversions or GGUF files given by path, and any of them can be deleted) and the hub
    cache's model repos.
    """
    names = []
    used_by: dict[str, str] = {}  # conversion cache entry -> the short name it serves
    for source in sources.MODEL_SOURCES.values():
        try:
            found = source.find()
        except ModelError:
            found = None
        ready = found is not None and found.is_dir()
        if found is not None and not found.is_dir():
            target = cache_target(found, source.cache_prefix)
            ready = (target / "config.json").is_file()
            used_by[target.name] = source.name
        names.append({
            "name": source.name,
            "default": source.name == DEFAULT_MODEL,
            "description": source.description,
            "package": source.package,
            "installed": source.installed,
            "converted": ready,
            "path": str(found) if found is not None else None,
        })
    models_dir = cache_dir() / "models"
    converted = []
    with contextlib.suppress(OSError):
        for entry in sorted(models_dir.iterdir()):
            # Hidden entries are conversions in progress or left by a killed run.
            if entry.name.startswith(".") or not (entry / "config.json").is_file():
                continue
            size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file())
            converted.append({"name": entry.name, "path": str(entry), "size_bytes": size,
                              "short_name": used_by.get(entry.name)})
    return {
        "default": DEFAULT_MODEL,
        "short_names": names,
        "converted": {"cache_dir": str(models_dir), "models": converted},
        "hub": {"cache_dir": str(hub_cache_dir()), "models": hub_models()},
    }
