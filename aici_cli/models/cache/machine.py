"""Which machine a cache folder was made on, so that one restored from another (a CI
job's cache, a copied home directory) is rebuilt where it is bound to its CPU, never
used.

The whole cache folder (`cache_dir()`) is what a CI job keeps: the conversions and their
packed layouts (`models/`, keyed by content and by the layout a probe packs on the
machine, so they serve any machine that packs alike), and the parts made for one CPU:
MACHINE_BOUND, the compiled steps, the int kernels' libraries, the kernel probe's and
the deterministic check's verdicts. Each of those is keyed by the machine already (a
package by the CPU's fingerprint, a library by its variant's flags), so another CPU's
entries are never picked; this record makes the check explicit and frees the folder of
them: `MACHINE_FILE` at the folder's root names the CPU (`CpuFeatures.fingerprint`)
that made it, and the first load on another CPU removes the machine-bound folders and
records itself (`check_machine`); they are then rebuilt here as on a fresh machine.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from aici_cli.core.cache_paths import cache_dir
from aici_cli.models.kernels.cpu_features import cpu_features

MACHINE_FILE = "machine.json"
# The cache's folders whose entries only the CPU that made them may use.
MACHINE_BOUND = ("compiled-steps", "kernels", "kernel-probe", "invariance")


def check_machine(root: Path | None = None) -> str | None:
    """Record this CPU as the maker of the cache at `root` (default `cache_dir()`), or,
    where another CPU made it, remove its MACHINE_BOUND folders first: a note saying so
    then (None where the cache is this machine's or new). A cache that cannot be
    written is left as it is."""
    root = cache_dir() if root is None else root
    mine = cpu_features().fingerprint
    record = root / MACHINE_FILE
    try:
        made_on = json.loads(record.read_text()).get("fingerprint")
    except (OSError, ValueError, AttributeError):
        made_on = None
    if made_on == mine:
        return None
    removed = [name for name in MACHINE_BOUND if (root / name).exists()] \
        if made_on is not None else []
    try:
        for name in removed:
            _remove(root / name)
        root.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{MACHINE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({"fingerprint": mine}))
        os.replace(tmp, record)
    except OSError:
        return None
    if made_on is None:
        return None
    return (f"the cache {root} was made on another CPU ({made_on}); its "
            f"{', '.join(removed) or 'machine-bound parts'} are rebuilt here ({mine})")


def _remove(folder: Path) -> None:
    """Remove `folder` at once for every reader: renamed aside first, then deleted."""
    aside = folder.with_name(f".{folder.name}.removed-{os.getpid()}")
    os.replace(folder, aside)
    shutil.rmtree(aside, ignore_errors=True)
