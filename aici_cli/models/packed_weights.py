"""A converted model's quantised linear layers, kept in their kernels' layout.

Packing a GGUF's 4-bit codes into the int4 kernel's layout and requantising the output
projection to int8 cost ~0.4 s of the default model's start on a 2-core CPU, with a float
copy of each matrix for a moment. The result depends only on the conversion, the mode,
the activation dtype, the device type, torch's version and the CPU capability its
kernels were built for (the CPU int4 layout is blocked per instruction set): so the
first run that quantises a conversion keeps its layers' buffers in one safetensors file
inside the conversion's cache entry (`packed_file`), and later runs read them (~90 MB,
tens of ms).

Only entries of the conversion cache get such a file: a model directory of the user's
is never written into. A file that is unreadable, or does not fit the model layer for
layer, is ignored and written again; two runs that write it at once each write a
temporary file and rename it into place, so a reader never sees half a file.

The buffers are the layers' own state (`Int4Linear`: `packed`, `scale_zero`;
`Int8Linear`: `codes`, `scale`) under the layer's name, as in the model's state dict.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch

from aici_cli.models.aligned import save_aligned, without_padding
from aici_cli.models.conversion_cache import models_dir

# Bump when what a layer keeps, or how it is computed, changes.
_LAYOUT_VERSION = "2"  # 2: tensors at 64-byte boundaries of the file (`aligned`)

BUFFERS = {"int4": ("packed", "scale_zero"), "int8": ("codes", "scale")}


def packed_file(path: Path, mode: str, dtype: torch.dtype, device: torch.device) -> Path | None:
    """Where the layers of the model at `path`, quantised in `mode` for `dtype` on
    `device`, are kept; None unless `path` is a conversion-cache entry."""
    try:
        path.resolve().relative_to(models_dir().resolve())
    except (ValueError, OSError):
        return None
    capability = torch.backends.cpu.get_cpu_capability() if device.type == "cpu" else ""
    key = f"{_LAYOUT_VERSION};torch={torch.__version__};cap={capability}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    dtype_name = str(dtype).removeprefix("torch.")
    return path / f"aici-packed-{mode}-{dtype_name}-{device.type}-{digest}.safetensors"


def read_packed(file: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The buffers kept in `file` by state-dict name, on `device`; empty when there is
    no such file or it cannot be read."""
    if not file.is_file():
        return {}
    from safetensors.torch import load_file

    try:
        return without_padding(load_file(str(file), device=str(device)))
    except Exception:  # noqa: BLE001 - truncated or corrupt: computed and written again
        return {}


def write_packed(file: Path, buffers: dict[str, torch.Tensor]) -> None:
    """Keeps `buffers` in `file`, atomically; a cache that cannot be written is skipped
    (the run goes on with the layers it computed)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
        os.close(fd)
        save_aligned({k: v.contiguous().cpu() for k, v in buffers.items()}, tmp)
        os.replace(tmp, file)
        tmp = None
    except Exception:  # noqa: BLE001 - a read-only or full cache: computed again next run
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
