"""What `aici-batch doctor` reports: this machine's fingerprint, the kernel probe's
verdict on every mode a model can run in here, and the mode `auto` picks.

Every verdict comes from the probe's cache (`kernel_probe.verdict`), or from a probe run
now and cached: the report costs a few seconds per mode the first time, and nothing after.
"""

from __future__ import annotations

import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from aici_cli.models import vnni_kernels
from aici_cli.models.device import DTYPES, pick_device, pick_dtype
from aici_cli.models.kernel_probe import (
    KernelChoice,
    KernelMode,
    Shapes,
    choose_kernels,
    current_mode,
    fingerprint,
    verdict,
)
from aici_cli.models.quantize import MODES, resolve_mode
from aici_cli.models.resolve import resolve_with_name

# ATen's CPU capabilities on x86, weakest first (`ATEN_CPU_CAPABILITY`).
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


def capabilities(every: bool) -> list[str]:
    """The CPU capabilities to probe: this process's, or (`every`) each one this CPU
    supports, up to the one torch chose."""
    chosen = torch.backends.cpu.get_cpu_capability()
    if not every or platform.machine().lower() not in ("x86_64", "amd64") \
            or chosen not in X86_CAPABILITIES:
        return [chosen]
    return list(X86_CAPABILITIES[:X86_CAPABILITIES.index(chosen) + 1])


def auto_kernels(path: Path, device: torch.device) -> KernelChoice:
    """The mode `--dtype auto --quantize auto` runs the model at `path` in on `device`:
    the first the kernel probe passes (the probe runs where no verdict is cached)."""
    dtype = pick_dtype("auto", device)
    return choose_kernels(path, device.type, "auto", "auto",
                          str(dtype).removeprefix("torch."), resolve_mode("auto", path, dtype),
                          lambda dt: resolve_mode("auto", path, DTYPES[dt]))


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
    # The VNNI kernels (vnni_kernels): bf16 quantised runs take them where this passes.
    vnni = vnni_kernels.unusable() if torch_device.type == "cpu" else "not a CPU run"
    if vnni is None:
        mode = current_mode("cpu", "bfloat16", vnni_kernels.PROBE_QUANTIZE)
        found = vnni_kernels.probed(shapes)
        modes.append({**asdict(mode), "label": mode.label, **asdict(found)})
        vnni = None if found.ok else f"its probe rejected them: {found.reason}"
    auto_dtype = pick_dtype("auto", torch_device)
    choice = auto_kernels(path, torch_device)
    return {
        "machine": fingerprint(torch_device.type),
        "torch": torch.__version__,
        "capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": auto_dtype == torch.bfloat16 if torch_device.type == "cpu" else None,
        "model": name, "path": str(Path(path)), "shapes": asdict(shapes),
        "modes": modes,
        "auto": {"dtype": choice.dtype, "quantize": choice.quantize,
                 "rejected": [list(r) for r in choice.rejected]},
        "vnni": {"used": vnni is None, "why_not": vnni},
    }
