"""One packed forward pass over every row of a step: tensors and plain data only, never
a `Generation` (import-linter holds that).

    passes.py         the pass: the step's rows, fed tokens and positions read → logits
    inputs.py         the packed input: token ids, positions, the attention layout
    attention.py      attention over each row's cache (SDPA, or the deterministic tiles)
    cache.py          `RowCache`: the per-row KV cache
    compiled.py       the `torch.compile`d one-token step (`--compile`)
    packaged_step.py  that step built ahead of time as an AOTInductor package, per machine
    decode_layer.py   its decoder layer, over fused projections
    deterministic.py  `--deterministic`: kernels whose result does not depend on the batch
"""
