"""How near a quantised tiny model stays to its bf16 self: the tolerance stated once for
tests/models/quant/test_quantize.py and tests/models/families/test_own_families.py."""

# Stated tolerances against the bf16 model on the tiny random model (hidden 64, logits of
# magnitude up to ~1.1): KL of the next-token distributions (mean over positions) and the
# largest logit difference. Measured: int8 KL 2e-6, max 0.010; int4 KL 1e-4, max 0.068.
TOLERANCE = {"int8": (1e-4, 0.02), "int4": (2e-3, 0.1)}
