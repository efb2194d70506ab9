"""Every model `--model` can name on this machine: the data of `aici-batch models`.

Torch-free: listing reads package metadata and directories, and imports transformers only
for its version (the conversion cache's key), which does not import torch.
"""

from __future__ import annotations

from typing import Any

from aici_cli.core.errors import ModelError
from aici_cli.models.cache.conversions import cache_target, models_dir
from aici_cli.models.cache.entries import cache_entries
from aici_cli.models.sources import packaged
from aici_cli.models.sources.hub import hub_cache_dir, hub_models
from aici_cli.models.sources.packaged import DEFAULT_MODEL


def available_models() -> dict[str, Any]:
    """Every model `--model` can name on this machine, for `aici-batch models`.

    Nothing is converted, assembled or downloaded: short names report whether their
    package is installed and whether a converted copy is cached; then the conversion
    cache's entries (each with its size, the short name it serves, if any, what it was
    converted from, why nothing uses it where nothing does, and the files of modes other
    than the default in it: `--prune` removes those) and the hub cache's model repos.
    """
    names = []
    used_by: dict[str, str] = {}  # conversion cache entry -> the short name it serves
    for source in packaged.MODEL_SOURCES.values():
        try:
            found = source.find()
        except ModelError:
            found = None
        ready = found is not None and found.is_dir()
        if found is not None and not found.is_dir():
            target = cache_target(found, source.cache_prefix, source.package)
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
    converted = [{"name": e.path.name, "path": str(e.path), "size_bytes": e.size_bytes,
                  "short_name": used_by.get(e.path.name), "origin": e.origin,
                  "files": e.files, "unused": e.unused,
                  "other_modes": [{"name": f.path.name, "size_bytes": f.size_bytes,
                                   "unused": f.unused} for f in e.extra]}
                 for e in cache_entries() if not e.path.name.startswith(".")]
    return {
        "default": DEFAULT_MODEL,
        "short_names": names,
        "converted": {"cache_dir": str(models_dir()), "models": converted,
                      "total_bytes": sum(m["size_bytes"] for m in converted)},
        "hub": {"cache_dir": str(hub_cache_dir()), "models": hub_models()},
    }
