"""The int kernels' weights moved onto 2 MiB pages, where the kernel lends them.

A one-token step streams every weight once (a 1.1B Llama at int4: ~650 MB a token), and a
weight read from its memory-mapped cache file sits on 4 KiB pages: a page walk every 4 KiB
and a hardware prefetcher that stops at each page's end. The same bytes copied into
anonymous memory advised `MADV_HUGEPAGE` stream faster: one-row int4 products over 260 MB
of tiles read 1.16x the bytes a second on 2 MiB pages on a 2-core EPYC (median of 8
alternating pairs, AVX2 variant), and a plain read 1.08x.

The copy costs one read of the weights a run uses at load, from the page cache, and keeps
them in anonymous memory, where a mapped file's pages are the page cache's to drop; what a
run reads every step is resident either way. Where transparent huge pages are off
(`never`), or the madvise is refused, nothing is copied: 4 KiB anonymous pages gain
nothing over the file's.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from aici_cli.models.kernels.aligned import read_header

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor at a cache line (aligned.py: what a kernel's loads may assume)
# Tensors under this size stay where they are: a few pages each, nothing to gain.
MIN_BYTES = 1 << 20
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def available() -> bool:
    """Whether this kernel hands out 2 MiB pages to memory advised so (`always` or
    `madvise` selected): read once a call, a few µs."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[never]" not in setting and hasattr(mmap, "MADV_HUGEPAGE")


class OnHugePages(Mapping[str, torch.Tensor]):
    """A kept safetensors file's tensors (`tensors`: as safetensors maps them from `file`),
    each of at least `MIN_BYTES` read from the file into a region of anonymous memory
    advised `MADV_HUGEPAGE` the first time it is read (64-byte aligned, same dtype, shape
    and bytes), the others as mapped; all as mapped where huge pages are not available.

    Read with `preadv` from the page cache, not copied from the mapping: the mapped pages
    of a big tensor are never touched, so they never count in the process's memory (a copy
    through them held both, ~2x the weights, and faulted every 4 KiB page in: 0.5-1 s of a
    1.1B Llama's load). The region is reserved for every big tensor and costs memory only
    where one was read: a kept file's layers of another mode stay unread. It lives as long
    as any tensor in it."""

    def __init__(self, file: Path, tensors: dict[str, torch.Tensor]) -> None:
        self._given = tensors
        self._copies: dict[str, torch.Tensor] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # name -> (file offset, region offset)
        self._file = file
        self._region: mmap.mmap | None = None
        self._identity: tuple[int, ...] = ()
        self._start = 0
        if not available():
            return
        try:
            spans, self._identity = _data_offsets(file)
        except (OSError, ValueError, KeyError, TypeError, struct.error):
            return
        size = 0
        for name, t in tensors.items():
            if name in spans and spans[name][1] == _nbytes(t) >= MIN_BYTES:
                self._spans[name] = (spans[name][0], size)
                size += -(-_nbytes(t) // ALIGN) * ALIGN
        if not self._spans:
            return
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            region.close()
            self._spans = {}
            return
        self._region = region
        # from the first 2 MiB boundary on: whole huge pages
        self._start = -torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._given[name]
        if self._region is None or name not in self._spans:
            return t
        if name not in self._copies:
            at_file, at = self._spans[name]
            at += self._start
            try:
                with open(self._file, "rb") as f:
                    if _identity(f.fileno()) != self._identity:
                        return t  # replaced since its header was read: offsets may differ
                    _read_exactly(f.fileno(), memoryview(self._region)[at: at + _nbytes(t)],
                                  at_file)
            except (OSError, EOFError):
                return t  # gone or shrunk: the mapped tensor still reads
            # torch.frombuffer holds the region for as long as the tensor lives
            raw = torch.frombuffer(self._region, dtype=torch.uint8, count=_nbytes(t),
                                   offset=at)
            self._copies[name] = raw.view(t.dtype).view(t.shape)
        return self._copies[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._given)

    def __len__(self) -> int:
        return len(self._given)


def _data_offsets(file: Path) -> tuple[dict[str, tuple[int, int]], tuple[int, ...]]:
    """Each tensor's (offset of its bytes in `file`, byte count), from its safetensors
    header (an 8-byte little-endian length, then JSON), and the file's identity then."""
    with open(file, "rb") as f:
        header, base = read_header(f)
        identity = _identity(f.fileno())
    return {name: (base + entry["data_offsets"][0],
                   entry["data_offsets"][1] - entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"}, identity


def _identity(fd: int) -> tuple[int, ...]:
    """Which file, and which version of it, `fd` reads: a kept file is replaced whole
    (`packed_layers.write_packed`: a new inode), never written in place."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _read_exactly(fd: int, into: memoryview, offset: int) -> None:
    done = 0
    while done < len(into):
        got = os.preadv(fd, [into[done:]], offset + done)
        if got == 0:
            raise EOFError(f"{len(into) - done} bytes short")
        done += got


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
