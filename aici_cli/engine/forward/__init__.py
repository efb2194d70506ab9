"""One packed forward pass over every row of a step: tensors and plain data only, never
a `Generation` (import-linter holds that).

    passes.py         the pass: the step's rows, fed tokens and positions read → logits
    inputs.py         the packed input: token ids, positions, the attention layout
    attention.py      attention over each row's cache (SDPA, or the deterministic tiles)
    packed_runs.py    the multi-token rows' attention in one call, where launches bind
    cache.py          `RowCache`: the per-row KV cache
    compiled.py       the `torch.compile`d one-token step (`--compile`)
    decode_steps.py   which one-token steps run compiled, and why the others ran eager
    packaged_step.py  that step built ahead of time as an AOTInductor package, per machine
    step_builds.py    the packages a run lacks, built by a niced process of its own
    step_builder.py   that process
    build_decision.py whether such a build pays within the run that starts it
    decode_layer.py   its decoder layer, over fused projections
    deterministic.py  `--deterministic`: kernels whose result does not depend on the batch
"""
