"""Choosing the torch device and the dtype weights load in, from the CLI's specs."""

from __future__ import annotations

import re

import torch

from aici_cli.core.errors import ModelError
from aici_cli.models.kernels.cpu_features import cpu_features

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
    if device.type == "cpu" and cpu_features().native_bf16:
        return torch.bfloat16
    return torch.float32
