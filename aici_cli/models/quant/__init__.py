"""Quantised linear layers (`--quantize int8|int4`), one module per concern: the layers on
PyTorch's kernels or the project's own, their stacks for the compiled step and for
eager passes, and dense copies for passes of many rows.

A layer's few-row passes (decode) run its int kernel: the project's own (`kernels/`)
where this machine runs and the probe passed it, else PyTorch's int4/int8 kernels. Passes
of many rows (prefill) run on a dense copy where a trial shows this machine's dense GEMM
faster (`dense_copies.py`). Each choice is made once per layer kind, in its layer class.

Modules (all import torch):

    quantize.py      Int4Linear, Int8Linear, int8_mm, the --quantize modes
    model_layers.py  a model's linears replaced (quantize_model), kept in the cache
    fused_linear.py  q/k/v and gate/up as one matrix each, compiled and eager passes
    dense_copies.py  passes of many rows on dense copies of the int4 layers
    vnni_layouts.py  the layers on the int kernels alone, their tiles kept in the cache
"""
