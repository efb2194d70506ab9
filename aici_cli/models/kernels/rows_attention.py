"""The eager passes' attention of one-token rows over each row's own cache slots:
`aici::rows_attention` (native/rows_attention.c), built into the int kernels' library
(int_mm.py) with each variant's flags, where it applies."""

from __future__ import annotations

import torch

# native/rows_attention.c's own flags beyond the variant's (int_mm.py builds it): sums in
# vector lanes, and fmaxf and its polynomial exp vectorised (its header says why each).
ATTENTION_FLAGS = ("-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
                   "-fno-math-errno", "-ffinite-math-only")

# The dtypes of q, k and v it takes (native/rows_attention.c reads bf16 as float32).
OPERATOR_DTYPES = (torch.float32, torch.bfloat16)

# Query heads a key/value head the operator takes (native/rows_attention.h AICI_MAX_REP).
MAX_REP = 16


def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                   scale: float) -> torch.Tensor | None:
    """Each row's attention over its first `lengths[s]` slots where the operator applies:
    float32 or bf16 on the CPU (float32 arithmetic either way, a bf16 output rounded
    once), in a process that loaded the int kernels' library (int_mm.py registers the
    operator with it). q [S, G, R, D]; k, v [>= S, G, slots, D] (views); lengths [S]
    int64; returns [S, G, R, D] in q's dtype (a row of length 0: zeros), or None where it
    does not apply (the caller attends as before)."""
    if q.dtype not in OPERATOR_DTYPES or k.dtype != q.dtype or q.device.type != "cpu" \
            or q.shape[2] > MAX_REP or not hasattr(torch.ops.aici, "rows_attention"):
        return None
    return torch.ops.aici.rows_attention(q, k, v, lengths, scale)
