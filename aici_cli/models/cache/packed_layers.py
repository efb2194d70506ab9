"""A conversion's quantised linear layers, kept in their kernels' layout.

The first run of a conversion in a quantised mode builds its layers from the GGUF (the
4-bit blocks packed into the int4 kernel's layout, the output projection requantised to
int8: ~0.4 s for the default model, ~seconds for a 1B model) and keeps them in one
safetensors file inside the conversion's cache entry (`packed_file`); later runs read
it (~90 MB, tens of ms). Nothing else of those matrices is stored: no dense copy, no
second copy of the blocks.

What a file depends on, and so its name:

- int4 on the CPU: `_convert_weight_to_int4pack_for_cpu`'s layout, which ATen chooses by
  the CPU capability its kernels were built for: AVX-512 packs 64 output rows per block
  (rows n and n + 32 share a byte, in two 128-bit lanes), AVX2 32 (rows n and n + 16),
  the default build 32 (rows n and n + 1). The name carries a digest of the layout, taken
  from packing a probe matrix on this machine (`int4_layout`): capabilities (or torch
  versions) that pack alike share a file, ones that differ never read each other's.
- int4 on CUDA: tinygemm's layout (`_convert_weight_to_int4pack`), digested alike.
- int8 (`_weight_int8pack_mm` takes a plain [N, K] int8 matrix and a scale per row):
  nothing but the codes, the same on every CPU and on CUDA: one file.

Scales are kept as computed (an int4 layer's d and m, the GGUF's float16, or float32 for
a K-quant's products and where quantised here; an int8 layer's float32 scale), and
rounded to the run's activation dtype as the layer is built, exactly as a freshly
computed layer rounds them: one file serves bfloat16, float16 and float32 runs.

Only entries of the conversion cache get such a file: a model directory of the user's
is never written into. A file that is unreadable, of another layout version, or does not
fit the model layer for layer, is ignored and written again; two runs that write it at
once each write a temporary file and rename it into place, so a reader never sees half a
file.
"""

from __future__ import annotations

import functools
import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from aici_cli.models.cache.conversions import models_dir
from aici_cli.models.cache.entry_files import PACKED_PREFIX
from aici_cli.models.kernels.aligned import save_aligned, without_padding
from aici_cli.models.kernels.int_mm import LAYOUT as VNNI_LAYOUT

# Bump when what a layer keeps, or how it is computed, changes.
LAYOUT_VERSION = "4"  # 2: tensors at 64-byte boundaries (`aligned`); 3: scales as
# computed, one file per kernel layout (not per dtype and CPU capability); 4: K-quant
# matrices from their blocks (`kquant`), Q6_K ones int8 in int4 files
_VERSION_KEY = "aici:layout"

# What each kind of layer keeps, by the suffix of its name.
KEPT = {"int4": ("packed", "d", "m"), "int8": ("codes", "scale")}


def packed_file(path: Path, mode: str, device: torch.device) -> Path | None:
    """Where the layers of the model at `path`, quantised in `mode` on `device`, are
    kept; None unless `path` is a conversion-cache entry."""
    if not _in_cache(path):
        return None
    if mode == "int8":
        return path / f"{PACKED_PREFIX}int8.safetensors"
    return path / f"{PACKED_PREFIX}{mode}-{int4_layout(device.type)}.safetensors"


def vnni_file(path: Path) -> Path | None:
    """Where the layers of the model at `path` are kept in the VNNI kernels' layouts
    (`vnni_layouts`: the same on every CPU that runs them); None unless `path` is a
    conversion-cache entry."""
    return path / f"{PACKED_PREFIX}vnni-{VNNI_LAYOUT}.safetensors" if _in_cache(path) else None


def _in_cache(path: Path) -> bool:
    try:
        path.resolve().relative_to(models_dir().resolve())
    except (ValueError, OSError):
        return False
    return True


@functools.cache
def int4_layout(device_type: str) -> str:
    """`cpu-<digest>` or `cuda-<digest>`: the int4 kernel's packed layout on this machine,
    as the digest of a probe matrix packed by it (a few microseconds, once)."""
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (128, 256), generator=generator, dtype=torch.int32)
    if device_type == "cuda":
        pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).to(torch.uint8).cuda()
        packed = torch.ops.aten._convert_weight_to_int4pack(pairs, 8).cpu()
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    digest = hashlib.sha256(packed.contiguous().view(torch.uint8).numpy().tobytes())
    return f"{device_type}-{digest.hexdigest()[:12]}"


def pack_int4_cpu(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes in 0..15 (any integer dtype) in `_convert_weight_to_int4pack_for_cpu`'s
    layout: [N, K/2] uint8.

    The op takes the codes as int32 (4 bytes a weight: a 1B-weight model's are 4 GB to
    write and read again); the layouts it makes (module docstring) are computed here from
    one byte a code instead, 2-3x faster, where one of them is found to be this
    machine's: the first that gives the op's own bytes on probe matrices. Elsewhere, the
    op."""
    n, k = codes.shape
    layout = _cpu_layout()
    if layout is None:
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)
    return layout(codes.to(torch.uint8).contiguous()).view(n, k // 2)


def _pairs(codes: torch.Tensor) -> torch.Tensor:
    """Rows 2j and 2j + 1 of [R, K] one-byte codes in one byte (2j low), K-major:
    [K * R/2] bytes. The layout of a block of rows every build packs alike."""
    r, k = codes.shape
    rows = codes.view(r // 2, 2, k)
    return (rows[:, 0] | (rows[:, 1] << 4)).t().reshape(-1)


def _lanes(block: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """AVX-512 (`block` 64) and AVX2 (32): in each block of rows, lane i of 16 rows shares
    its bytes with lane i + lanes/2 (high nibble), K-major; a last, shorter block as
    `_pairs`."""
    def pack(codes: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        full = n // block * block
        lanes = codes[:full].view(full // block, block // 16, 16, k)
        half = block // 32
        packed = (lanes[:, :half] | (lanes[:, half:] << 4)).permute(0, 3, 1, 2).reshape(-1)
        return torch.cat([packed, _pairs(codes[full:])]) if n > full else packed
    return pack


def _unlanes(block: int) -> Callable[[torch.Tensor, int, int], torch.Tensor]:
    """`_lanes(block)` undone: [N*K/2] bytes to [N, K] codes."""
    def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
        full = n // block * block
        blocks = packed[: full * k // 2].view(full // block, k, block // 32, 16)
        lanes = torch.cat([blocks & 15, blocks >> 4], dim=2)  # [blocks, K, block/16, 16]
        codes = lanes.permute(0, 2, 3, 1).reshape(full, k)
        if n == full:
            return codes
        rest = packed[full * k // 2 :].view(k, (n - full) // 2)  # `_pairs`: K-major
        pairs = torch.stack([rest & 15, rest >> 4], dim=2).reshape(k, n - full).t()
        return torch.cat([codes, pairs])
    return unpack


def _adjacent(codes: torch.Tensor) -> torch.Tensor:
    """The default build: blocks of 32 rows, rows 2j and 2j + 1 in one byte, K-major."""
    n, k = codes.shape
    full = n // 32 * 32
    rows = codes[:full].view(full // 32, 16, 2, k)
    packed = (rows[:, :, 0] | (rows[:, :, 1] << 4)).permute(0, 2, 1).reshape(-1)
    return torch.cat([packed, _pairs(codes[full:])]) if n > full else packed


@functools.cache
def _cpu_layout() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The layout of `_LAYOUTS` that packs as this machine's op does, or None."""
    generator = torch.Generator().manual_seed(1)
    probes = [torch.randint(0, 16, shape, generator=generator, dtype=torch.int32)
              for shape in ((176, 64), (128, 256), (80, 96))]  # whole blocks and a rest
    wanted = [torch.ops.aten._convert_weight_to_int4pack_for_cpu(p, 1).reshape(-1)
              for p in probes]
    for layout in _LAYOUTS:
        if all(torch.equal(layout(p.to(torch.uint8)), w) for p, w in zip(probes, wanted)):
            return layout
    return None


_LANES_64, _LANES_32 = _lanes(64), _lanes(32)
_LAYOUTS = (_LANES_64, _LANES_32, _adjacent)
_INVERSES = {_LANES_64: _unlanes(64), _LANES_32: _unlanes(32)}


def unpacks() -> bool:
    """Whether this machine's layout has an inverse here (not the op's own, or the default
    build's)."""
    layout = _cpu_layout()
    return layout is not None and layout in _INVERSES


def unpack_int4_cpu(packed: torch.Tensor, n: int, k: int) -> torch.Tensor | None:
    """`pack_int4_cpu` undone: [N, K] uint8 codes from the layout's bytes; None where this
    machine's layout has no inverse (`unpacks`)."""
    layout = _cpu_layout()
    return _INVERSES[layout](packed.reshape(-1), n, k) if unpacks() and layout else None


def read_packed(file: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The layers' tensors kept in `file` by name (`<layer>.<kept>`), on `device`; empty
    when there is no such file, it cannot be read, or it is of another layout version."""
    if not file.is_file():
        return {}
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(file), framework="pt") as f:
            if (f.metadata() or {}).get(_VERSION_KEY) != LAYOUT_VERSION:
                return {}
        return without_padding(load_file(str(file), device=str(device)))
    except Exception:  # noqa: BLE001 - truncated or corrupt: computed and written again
        return {}


def write_packed(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Keeps `tensors` in `file`, atomically; a cache that cannot be written is skipped
    (the run goes on with the layers it computed)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
        os.close(fd)
        save_aligned({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp,
                     {_VERSION_KEY: LAYOUT_VERSION})
        os.replace(tmp, file)
        tmp = None
    except Exception:  # noqa: BLE001 - a read-only or full cache: computed again next run
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
