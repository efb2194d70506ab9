"""The masked projection: the output projection only for the tokens a row's mask allows.

A row whose mask allows few tokens (a JSON key, an enum, a digit) needs the logits of
those tokens alone: `hidden @ W[allowed].T` costs n/V of the full projection (49,152 x
576 in the default model). The pass hands back the rows' final hidden states instead of
logits (`ModelPass.run(project=False)`); once the masks are known, `MaskedProjection.project`
makes full-width logits rows: -inf everywhere but the allowed ids, so masks and sampling
downstream run unchanged.

Same tokens as the full projection, by kernel:
- `Int8Linear` on CPU (`_weight_int8pack_mm`, or the VNNI kernel for bf16 rows where the
  head has it): each output channel is its own dot product over K in a fixed order, so
  the gathered codes and scales give the full projection's values bit for bit
  (tests/engine/logits/test_masked_projection.py): greedy and sampled rows alike.
- dense `nn.Linear` (fp32 MKL, bf16 oneDNN): the kernels block K by the matrix's shape,
  so a gathered matrix's values differ from the full one's in the last bits (measured:
  fp32 at every size, bf16 at K=2048). There it is taken for greedy rows only,
  and only where the gathered argmax wins by more than both computations' rounding bound
  (`_clear_argmax`); otherwise the step takes the full projection.
Either every row of a pass is projected masked or none: a projection over fewer rows need
not give a row the values the whole batch's would (bf16 at K=2048 does not).

Not taken (the full projection as before): a row that reads logprobs, has logit rules or
is unconstrained, a pass with drafts or scored positions, a model whose output projection
is not a plain `nn.Linear` or `Int8Linear` (int4 keeps its kernel's packed layout, which
has no rows to gather), that soft-caps its logits, or that is not the project's own Llama
module (the others cannot return hidden states); the deterministic mode (its tiled
linears run only inside the pass); CUDA (cuBLAS picks kernels by shape).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from aici_cli.engine.logits.sampler import MIN_TEMPERATURE, Draw
from aici_cli.models.families.llama import LlamaCausalLM
from aici_cli.models.quant.quantize import Int8Linear, int8_mm

# A row takes the masked projection when its mask allows at most this many tokens. Measured on
# the default model's projection (49,152 x 576; bench/masked_projection.py, docs/speed.md):
# at 512 allowed, int8 and fp32 cost 0.09-0.37 of the full projection (batch 1 and 8), at
# 4096 0.7-2.8x.
THRESHOLD = 512
# A 16-bit dense projection's margin check refuses more often as the set grows (its values
# are rounded to 8 bits; a refusal pays the gathered product and the full one): at 512
# allowed, batch 8, it refused every time (1.3x the full projection); at 64 it paid, 0.12.
DENSE_16BIT_THRESHOLD = 64

# Unit roundoff of each output dtype (the fp32 accumulator's is in `_gamma`).
_ROUNDOFF = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


class MaskedProjection:
    """The output projection of one model, whole (`full`) or at allowed ids (`project`).
    `exact`: the gathered values equal the full projection's (int8), so sampled rows may
    take it too. `used`: the passes projected masked (for tests and benches)."""

    def __init__(self, head: torch.nn.Module, vocab_size: int,
                 threshold: int = THRESHOLD) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.threshold = threshold
        self.exact = isinstance(head, Int8Linear)
        # Int8: its rows' codes (`Int8Linear.rows`) and scale [V]; dense: weight [V, K].
        # Bias [V] or None.
        self.int8: Int8Linear | None = head if isinstance(head, Int8Linear) else None
        self.scale: torch.Tensor | None = head.scale if isinstance(head, Int8Linear) else None
        # The head's bf16 passes on the VNNI kernel (models/kernels/int_mm.py): its rows are
        # gathered and tiled for that kernel, whose rows' values are the full one's.
        self.vnni_scale: torch.Tensor | None = head.vnni_scale \
            if isinstance(head, Int8Linear) and head.vnni else None
        self.weight: torch.Tensor | None = getattr(head, "weight", None)
        self.bias: torch.Tensor | None = getattr(head, "bias", None)
        self.used = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, vocab_size: int, device: torch.device,
                  deterministic: bool, threshold: int = THRESHOLD) -> MaskedProjection | None:
        """The masked projection for `model`, or None where it does not apply (module docstring)."""
        if deterministic or device.type != "cpu" or not isinstance(model, LlamaCausalLM):
            return None
        if getattr(model.config, "final_logit_softcapping", None):
            return None
        head = model.lm_head
        if type(head) is torch.nn.Linear and head.weight.dtype in _ROUNDOFF:
            if head.weight.dtype != torch.float32:
                threshold = min(threshold, DENSE_16BIT_THRESHOLD)
            return cls(head, vocab_size, threshold)
        if isinstance(head, Int8Linear) and head.scale.device.type == "cpu":
            return cls(head, vocab_size, threshold)
        return None

    def may_use(self, draws: Sequence[Draw | None], masks: Sequence[object | None],
                rules: Sequence[object | None], logprobs: Collection[int],
                scored: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> bool:
        """Before the pass (plan fields by position): whether it may hand back hidden
        states. Every sampling row must be masked and greedy (or the kernel exact)."""
        if logprobs or any(drafts) or any(scored) or any(r is not None for r in rules):
            return False
        sampling = [k for k, d in enumerate(draws) if d is not None]
        return bool(sampling) and all(
            masks[k] is not None and (self.exact or _greedy(draws[k])) for k in sampling)

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        """[b, hidden] -> [b, V]: what the pass would have returned (the same module on
        the same rows), cut to the vocabulary."""
        logits = self.head(hidden)
        v = self.vocab_size
        return logits[:, :v] if logits.shape[-1] > v else logits

    def project(self, hidden: torch.Tensor, allowed: torch.Tensor | None,
                rows: Sequence[int]) -> torch.Tensor:
        """Logits [b, V] from the pass's hidden states [b, hidden]: where every row of
        `rows` (those that sample) allows (`allowed` [b, V] bool) at most `threshold`
        tokens, -inf rows with the allowed ids' values (other rows zeros: nothing reads
        them, and an empty mask still fails its row); otherwise the full projection."""
        if allowed is None or not rows:
            return self.full(hidden)
        # numpy, one thread: torch would fork its thread pool for each [V] op, and on
        # shared cores each fork can wait milliseconds for a busy core.
        masks = allowed.numpy()
        if int(masks[list(rows)].sum(axis=-1).max()) > self.threshold:
            return self.full(hidden)
        out = torch.full((hidden.shape[0], self.vocab_size), float("-inf"),
                         dtype=hidden.dtype, device=hidden.device)
        out[[k for k in range(hidden.shape[0]) if k not in rows]] = 0
        for k in rows:
            ids = torch.from_numpy(np.flatnonzero(masks[k])).to(hidden.device)  # [n]
            weight = None if self.exact else self._rows(ids)  # dense: [n, K], gathered once
            values = self._gathered(hidden[k : k + 1], ids, weight)[0]  # [n]
            if weight is not None and not _clear_argmax(values, hidden[k], weight):
                return self.full(hidden)
            out[k, ids] = values
        self.used += 1
        return out

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dense weight's rows at `ids` [n, K] (a copy: n K elements)."""
        assert self.weight is not None
        return self.weight[ids]

    def _gathered(self, hidden: torch.Tensor, ids: torch.Tensor,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
        """[r, hidden] -> [r, n]: the projection at `ids` alone, by the full one's kernel
        (gathering copies n K weight elements; the product costs n/V of the full one).
        `weight`: the dense rows at `ids`, where the caller gathered them already."""
        if self.int8 is not None and self.scale is not None:  # the full projection's kernel
            y = int8_mm(hidden, self.int8.rows(ids), self.scale[ids],
                        None if self.vnni_scale is None else self.vnni_scale[ids])
        else:
            y = F.linear(hidden, weight if weight is not None else self._rows(ids))
        return y + self.bias[ids] if self.bias is not None else y


def _greedy(draw: Draw | None) -> bool:
    return draw is not None and draw.sampling.temperature < MIN_TEMPERATURE


def _gamma(k: int) -> float:
    """Higham's gamma_k for an fp32 accumulator: any order of k products' sum is within
    gamma_k * sum |products| of the exact one."""
    u = 2.0**-24
    return k * u / (1 - k * u)


def _clear_argmax(values: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the full projection's argmax over these ids is provably the gathered one's.
    Both fp32 accumulations are within gamma_K S_t of the exact dot product (S_t =
    sum_i |h_i w_ti|), so within d_t = 2 gamma_K S_t of each other; a 16-bit output rounds
    each to nearest, monotone, which adds at most one ulp of the value (<= 2 u |x|, u the
    output's unit roundoff). So the full value is within tol_t = d_t + 2 u (|v_t| + d_t) of
    the gathered v_t, and the argmax is the same where the top value minus its tolerance
    beats every other value plus its own. `weight`: the gathered rows [n, K]. Costs one
    more [n, K] product, in float64 so the bound itself does not round."""
    if values.numel() == 1:
        return True
    u = _ROUNDOFF[values.dtype]
    scale = hidden.double().abs() @ weight.double().abs().T  # [n]: S_t
    v = values.double()
    apart = 2 * _gamma(weight.shape[-1]) * scale
    tol = (apart + 2 * u * (v.abs() + apart)) * (1 + 1e-6) + 1e-30
    best = int(v.argmax())
    above = v + tol
    above[best] = float("-inf")
    return bool(v[best] - tol[best] > above.max())
