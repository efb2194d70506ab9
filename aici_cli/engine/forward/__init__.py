"""One packed forward pass over every row of a step: tensors and plain data only, never
a `Generation` (import-linter holds that).

    passes        the pass: the step's rows, fed tokens and positions read → logits
    inputs        the packed input: token ids, positions, the attention layout
    attention     attention over each row's cache (SDPA, or the deterministic tiles)
    cache         `RowCache`: the per-row KV cache
    compiled      the `torch.compile`d one-token step (`--compile`)
    decode_layer  its decoder layer, over fused projections
    deterministic `--deterministic`: kernels whose result does not depend on the batch
"""
