"""Quantised linear layers (`--quantize int8|int4`), one module per concern: the layers on
PyTorch's kernels or the project's own, their stacks for the compiled step and for
eager passes, and dense copies for the prompt tokens of 16-bit passes.

A layer's generated tokens (decode, fast-forward chunks, drafts) run its int kernel: the
project's own (`kernels/`) where this machine runs and the probe passed it, else
PyTorch's int4/int8 kernels. A 16-bit run's prompt tokens run on a dense copy in tiles of
one shape where a trial shows this machine's dense GEMM faster (`dense_copies.py`,
`prompt_tokens.py`): a rule by token, so a line's text does not depend on its neighbours.

Modules (all import torch):

    quantize.py      Int4Linear, Int8Linear, int8_mm, the --quantize modes
    model_layers.py  a model's linears replaced (quantize_model), kept in the cache
    fused_linear.py  q/k/v and gate/up as one matrix each, compiled and eager passes
    dense_copies.py  dense copies of the int4 layers, and whether a run makes them
    prompt_tokens.py which tokens of a pass are prompt tokens, their tiled dense GEMM
    vnni_layouts.py  the layers on the int kernels alone, their tiles kept in the cache
"""
