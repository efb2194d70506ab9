"""Models in the local Hugging Face hub cache, read offline.

A hub id `org/name[@revision]` names a model only if it is already in the cache: nothing
is downloaded. Every huggingface_hub call here is local (`local_files_only=True`, or a
scan of the cache directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from aici_cli.core.errors import ModelError, one_line
from aici_cli.models.cache.conversions import converted_gguf, slug


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read from the environment as huggingface_hub reads it:
    `$HF_HUB_CACHE`, else `$HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
    `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.

    Read on every call rather than from `huggingface_hub.constants`, which freezes the
    environment at import time.
    """
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(explicit)).expanduser()
    home = os.environ.get("HF_HOME")
    if not home:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = os.path.join(xdg, "huggingface")
    return Path(os.path.expandvars(home)).expanduser() / "hub"


def hub_model(spec: str, repo: str, revision: str | None) -> Path:
    """The cached snapshot of hub repo `repo` at `revision` (default: main), offline.

    `snapshot_download(local_files_only=True)` reads `refs/<revision>` and returns
    `snapshots/<commit>/` without any network access; it refuses a snapshot that its
    cached file listing shows to be incomplete.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    hub = hub_cache_dir()
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=hub,
                                        local_files_only=True))
    except IncompleteSnapshotError as exc:
        raise ModelError(
            f"model {spec!r} is only partly in the Hugging Face hub cache {hub}: "
            f"{one_line(exc).removeprefix('IncompleteSnapshotError: ')}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        at = f" at revision {revision!r}" if revision else ""
        raise ModelError(
            f"model {spec!r} not found: no file or directory {Path(spec).absolute()} exists, "
            f"and {repo}{at} is not in the Hugging Face hub cache {hub} (nothing is "
            f"downloaded: fetch it once with `hf download {repo}` where there is network, "
            "or point HF_HUB_CACHE or HF_HOME at the cache that holds it)"
        ) from exc
    except Exception as exc:  # invalid ids, unreadable refs files
        raise ModelError(f"cannot read {spec!r} from the hub cache {hub}: {one_line(exc)}") \
            from exc
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    if len(ggufs) == 1:  # a GGUF-only repo: convert its one file like any other
        return converted_gguf(ggufs[0], slug(ggufs[0].stem))
    if ggufs:
        raise ModelError(
            f"model {spec!r} holds {len(ggufs)} .gguf files and no config.json: pass one of "
            f"them as --model, e.g. {ggufs[0]}"
        )
    raise ModelError(f"model {spec!r} in the hub cache has no config.json: {folder}")


def hub_models() -> list[dict[str, Any]]:
    """The model repos in the hub cache: id, refs, size, and whether `--model` can load
    them (their main snapshot holds config.json or a .gguf)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    hub = hub_cache_dir()
    try:
        info = scan_cache_dir(hub)
    except (CacheNotFound, OSError, ValueError):
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        refs = sorted(ref for rev in repo.revisions for ref in rev.refs)
        main = next((rev for rev in repo.revisions if "main" in rev.refs), None)
        snapshot = main.snapshot_path if main is not None else None
        loadable = snapshot is not None and (
            (snapshot / "config.json").is_file() or any(snapshot.glob("*.gguf"))
        )
        found.append({
            "name": repo.repo_id,
            "path": str(snapshot) if snapshot is not None else str(repo.repo_path),
            "refs": refs,
            "size_bytes": repo.size_on_disk,
            "loadable": loadable,
        })
    return found
