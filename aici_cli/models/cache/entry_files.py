"""The files a conversion-cache entry gains after its conversion, one set per mode, and
which of them `aici-batch models --prune` removes.

A conversion holds what every run reads (config, tokenizer, `BASE_FILE`). Each mode
adds its own on first use: a quantised mode its layers in one kernel layout
(`packed_layers`: `aici-packed-int4-<layout>`, `aici-packed-int8`), an unquantised run
the dense copy (`DENSE_FILE`, ~2x the GGUF). Files of modes that no longer run (another
CPU, another torch, a one-off `--dtype float32` run) would stay forever, so the runs of
the default mode (every choice left at auto: `--device`, `--dtype`, `--quantize`,
`--model-impl`) note which of these files they read (`note_default_files`, in the
entry's `SOURCE_FILE`, written only when it changes), and prune removes the others. A
mode pruned away builds its file again on its next run.

Torch-free.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path

from aici_cli.models.cache import conversions
from aici_cli.models.gguf.entry_record import BASE_FILE, DENSE_FILE, read_source, write_source

PACKED_PREFIX = "aici-packed-"  # `packed_layers`' files
_DEFAULT_KEY = "default_files"


@dataclass(frozen=True)
class ModeFile:
    """A file of one mode in an entry, and why prune removes it (None: it stays)."""

    path: Path
    size_bytes: int
    unused: str | None = None


def mode_files(entry: Path) -> list[ModeFile]:
    """The files in `entry` that a mode built after its conversion, each with why prune
    removes it: those the default mode's runs do not read, and temporary files a run
    that died while writing one left."""
    record = read_source(entry) or {}
    default = record.get(_DEFAULT_KEY)
    read = {f for f in default if isinstance(f, str)} if isinstance(default, list) else set()
    found = []
    stale_before = time.time() - conversions.STALE_TMP_SECONDS
    with contextlib.suppress(OSError):
        for path in sorted(entry.iterdir()):
            with contextlib.suppress(OSError):
                stat = path.stat()
                if path.name.startswith(f".{PACKED_PREFIX}") or \
                        path.name.startswith(f".{DENSE_FILE}."):
                    if stat.st_mtime < stale_before:
                        found.append(ModeFile(path, stat.st_size,
                                              "left by a run that died writing it"))
                elif is_mode_file(entry, path.name):
                    why = None if path.name in read else (
                        f"{what(path.name)}, which no run in the default mode reads")
                    found.append(ModeFile(path, stat.st_size, why))
    return found


def is_mode_file(entry: Path, name: str) -> bool:
    """Whether `name` in `entry` is a file a mode builds on first use (not part of the
    conversion itself)."""
    if name.startswith(PACKED_PREFIX) and name.endswith(".safetensors"):
        return True
    # A conversion of this version has no dense copy of its own; an older one's, or a
    # model directory's, model.safetensors is its weights.
    return name == DENSE_FILE and (entry / BASE_FILE).is_file()


def what(name: str) -> str:
    """What a mode file holds, for the user."""
    if name == DENSE_FILE:
        return "the unquantised copy (--quantize none, --dtype float32)"
    mode = name.removeprefix(PACKED_PREFIX).removesuffix(".safetensors")
    if mode == "int8":
        return "the layers of --quantize int8"
    if mode.startswith("vnni-"):
        return "the quantised layers in the int kernels' layouts (CPUs of AVX2 or NEON and up)"
    layout = mode.removeprefix("int4-")
    return f"the layers of --quantize int4 in the kernel layout {layout}"


def note_default_files(entry: Path, names: list[str]) -> None:
    """Record that a run in the default mode read the mode files `names` of `entry`
    (the last such run's are kept by prune). Written only when they change, under the
    entry's lock; a cache that cannot be written is left as it is."""
    record = read_source(entry)
    if record is None or record.get(_DEFAULT_KEY) == sorted(names):
        return
    with conversions.entry_lock(conversions.entry_key(entry)):
        record = read_source(entry)
        if record is not None and record.get(_DEFAULT_KEY) != sorted(names):
            write_source(entry, record | {_DEFAULT_KEY: sorted(names)})


def remove(file: ModeFile, entry: Path) -> None:
    """Remove a mode file, under its entry's lock (a run building that file at the same
    moment renames its own into place after, or waits)."""
    with conversions.entry_lock(conversions.entry_key(entry)), \
            contextlib.suppress(OSError):
        file.path.unlink()
