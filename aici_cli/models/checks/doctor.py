"""What `aici-batch doctor` reports: this machine's fingerprint, the kernel probe's
verdict on every mode a model can run in here, and the mode `auto` picks.

Every verdict comes from the probe's cache (`probe.verdict`), or from a probe run
now and cached: the report costs a few seconds per mode the first time, and nothing after.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from aici_cli.models.device import DTYPES, pick_device, pick_dtype
from aici_cli.models.kernels import int_mm
from aici_cli.models.kernels.cpu_features import cpu_features
from aici_cli.models.kernels.probe import (
    KernelChoice,
    KernelMode,
    Shapes,
    choose_kernels,
    current_mode,
    fingerprint,
    verdict,
)
from aici_cli.models.quant.quantize import MODES, resolve_mode
from aici_cli.models.sources.resolve import resolve_with_name


def capabilities(every: bool) -> list[str]:
    """The CPU capabilities to probe: this process's, or (`every`) each one this CPU
    supports, up to the one torch chose."""
    cpu = cpu_features()
    return cpu.capabilities_up_to_chosen() if every else [cpu.capability]


def auto_kernels(path: Path, device: torch.device) -> KernelChoice:
    """The mode `--dtype auto --quantize auto` runs the model at `path` in on `device`:
    the first the kernel probe passes (the probe runs where no verdict is cached)."""
    dtype = pick_dtype("auto", device)
    return choose_kernels(path, device.type, "auto", "auto",
                          str(dtype).removeprefix("torch."),
                          resolve_mode("auto", path, dtype, device),
                          lambda dt: resolve_mode("auto", path, DTYPES[dt], device))


def doctor_report(model: str | None, device: str = "auto",
                  every_capability: bool = False) -> dict[str, Any]:
    """The report as data: the machine, the model's shapes, each mode's verdict (in the
    order `auto` would try them first), and what `auto` picks."""
    torch_device = pick_device(device)
    path, name = resolve_with_name(model)
    shapes = Shapes.of(path)
    caps = capabilities(every_capability) if torch_device.type == "cpu" else [None]
    modes = []
    for capability in caps:
        for dtype in DTYPES:
            if torch_device.type == "cpu" and dtype == "float16":
                continue  # no CPU run picks it, and its kernels are emulated
            for quantize in MODES:
                mode = current_mode(torch_device.type, dtype, quantize)
                if capability is not None:
                    mode = KernelMode(mode.device, dtype, quantize, capability)
                found = verdict(mode, shapes)
                modes.append({**asdict(mode), "label": mode.label, **asdict(found)})
    # The project's int kernels (int_mm): quantised CPU runs take them where this passes,
    # probed at the dtype `auto` runs in here.
    vnni = int_mm.unusable() if torch_device.type == "cpu" else "not a CPU run"
    variant = int_mm.variant() if torch_device.type == "cpu" else None
    if vnni is None:
        dtype = str(pick_dtype("auto", torch_device)).removeprefix("torch.")
        mode = current_mode("cpu", dtype, int_mm.PROBE_QUANTIZE)
        found = int_mm.probed(shapes, dtype)
        modes.append({**asdict(mode), "label": mode.label, **asdict(found)})
        vnni = None if found.ok else f"its probe rejected them: {found.reason}"
    auto_dtype = pick_dtype("auto", torch_device)
    choice = auto_kernels(path, torch_device)
    return {
        "machine": fingerprint(torch_device.type),
        "torch": torch.__version__,
        "capability": cpu_features().capability,
        "native_bf16": auto_dtype == torch.bfloat16 if torch_device.type == "cpu" else None,
        "model": name, "path": str(Path(path)), "shapes": asdict(shapes),
        "modes": modes,
        "auto": {"dtype": choice.dtype, "quantize": choice.quantize,
                 "rejected": [list(r) for r in choice.rejected]},
        "vnni": {"used": vnni is None, "why_not": vnni,
                 "variant": variant.name if isinstance(variant, int_mm.Variant) else None},
        "isa_forced": cpu_features().forced,
    }
