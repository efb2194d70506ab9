"""A decoder's RMSNorm as one opaque call, `aici::rms_norm` (int_mm.cpp), for the
compiled one-token step: the same ATen calls as the norm module's own forward, so a
compiled step's norms give the eager passes' bits where inductor would fuse them and sum
the squares in an order of its own (a line's tokens would then depend on whether its
steps ran compiled, and on how many rows shared them)."""

from __future__ import annotations

from typing import overload

import torch

# The norm modules whose forward `aici::rms_norm` computes op for op: transformers'
# Llama-family classes and models/families/llama.py's; the offset ones scale by
# (1 + weight) in float32 (Gemma). Any other class keeps its own forward.
PLAIN = frozenset({"RMSNorm", "LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm",
                   "Qwen3RMSNorm"})
OFFSET = frozenset({"OffsetRMSNorm", "Gemma3RMSNorm"})


class NativeNorm(torch.nn.Module):
    """`norm` through `aici::rms_norm`, over the module's own weight (one Parameter)."""

    def __init__(self, norm: torch.nn.Module, offset: bool, eps: float) -> None:
        super().__init__()
        self.weight = norm.weight
        self.offset = offset
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aici.rms_norm(x, self.weight, self.eps, self.offset)


@overload
def native_norm(norm: torch.nn.Module) -> torch.nn.Module: ...


@overload
def native_norm(norm: None) -> None: ...


def native_norm(norm: torch.nn.Module | None) -> torch.nn.Module | None:
    """`norm` as a `NativeNorm` where the int kernels' library is loaded on a CPU model
    and the module is one `aici::rms_norm` computes; else `norm` itself."""
    if norm is None or not hasattr(torch.ops.aici, "rms_norm"):
        return norm
    name = type(norm).__name__
    weight = getattr(norm, "weight", None)
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if name not in PLAIN | OFFSET or not isinstance(weight, torch.Tensor) \
            or weight.device.type != "cpu" or not isinstance(eps, float):
        return norm
    return NativeNorm(norm, name in OFFSET, eps)
