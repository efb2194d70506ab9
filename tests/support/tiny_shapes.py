"""The tiny model's shapes (tiny_model.py: hidden 64, 2 layers) as the kernel probe
takes them, for the probe's tests (tests/models/kernels/test_kernel_probe.py,
tests/models/kernels/test_vnni_kernels.py)."""

from __future__ import annotations

from aici_cli.models.kernels.probe import Shapes

TINY = Shapes(hidden=64, intermediate=128, vocab=256, heads=4, kv_heads=2, head_dim=16,
              layers=2)
