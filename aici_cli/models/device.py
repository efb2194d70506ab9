"""Choosing the torch device and the dtype weights load in, from the CLI's specs."""

from __future__ import annotations

import platform
import re
import sys
from pathlib import Path

import torch

from aici_cli.core.errors import ModelError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def pick_device(spec: str) -> torch.device:
    """The torch device for a CLI spec: auto (CUDA when available, else CPU), cpu, cuda[:N]."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if spec == "cuda" or re.fullmatch(r"cuda:\d+", spec):
        if not torch.cuda.is_available():
            raise ModelError(f"device {spec!r} requested but CUDA is not available")
        device = torch.device(spec)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ModelError(
                f"device {spec!r} requested but only {torch.cuda.device_count()} CUDA "
                "device(s) exist"
            )
        return device
    raise ModelError(f"unknown device {spec!r}: expected 'auto', 'cpu' or 'cuda'")


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    """The dtype to load weights in, for a CLI spec: auto, float32, bfloat16 or float16.

    auto: bfloat16 on CUDA when the GPU supports it, else float16; on CPU bfloat16 only
    when the CPU has native bf16 instructions (without them bf16 matmuls are emulated and
    slower than float32), else float32. Explicit choices are honoured on any device.
    """
    if spec in DTYPES:
        return DTYPES[spec]
    if spec != "auto":
        raise ModelError(
            f"unknown dtype {spec!r}: expected 'auto', 'float32', 'bfloat16' or 'float16'"
        )
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and _cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def _cpu_has_native_bf16() -> bool:
    """Whether this CPU executes bf16 matmuls natively (x86 AVX512-BF16/AMX, arm BF16).

    Measured on a 2-core AMX Xeon (SmolLM2-135M): bf16 prefill ~4x and batch-8 decode ~1.6x
    faster than float32. Without native support bf16 is emulated and slower, and torch's
    capability string says "AVX512" on such CPUs too, so the precise probes come first.
    """
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        probes = [
            getattr(torch.cpu, name, None)
            for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        ]
        if all(callable(probe) for probe in probes):
            try:
                return any(probe() for probe in probes)  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - private API; fall back to the coarse check
                pass
        capability = torch.backends.cpu.get_cpu_capability().upper()
        return "AMX" in capability or "AVX512" in capability
    if machine in ("aarch64", "arm64") and sys.platform == "linux":
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
        return any(
            line.startswith("Features") and "bf16" in line.split() for line in cpuinfo.splitlines()
        )
    return False
