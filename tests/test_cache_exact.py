"""The per-row KV cache must give each row exactly the logits it would get alone.

Rows are ragged (different prompt lengths), feed chunks of different sizes in one pass
(a sampled token beside several forced ones), backtrack, and get refilled with a new
prompt while their neighbours keep decoding. After every pass each row's last logits are
compared with a cache-free forward pass over that row's whole token sequence.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aici_cli.engine.cache import RowCache
from aici_cli.engine.inputs import MaskShape, build_inputs
from aici_cli.models import LoadedModel, load_model

TOL = 1e-4


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> LoadedModel:
    return load_model(str(tiny_model_dir), device="cpu", dtype="float32")


def reference_logits(lm: LoadedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]))
    return out.logits[0, -1].float()


class Harness:
    """Drives RowCache + build_inputs the way the engine does, keeping each row's tokens."""

    def __init__(self, lm: LoadedModel, rows: int, capacity: int = 8) -> None:
        self.lm = lm
        self.cache = RowCache(lm.model.config.num_hidden_layers, rows, capacity)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows
        self.mask_shape = MaskShape.for_config(lm.model.config)

    def forward(self, rows: list[int], chunks: list[list[int]], fresh: bool) -> torch.Tensor:
        lengths = [self.lengths[r] for r in rows]
        self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, chunks)))
        inputs = build_inputs(
            rows if fresh else slice(rows[0], rows[-1] + 1), lengths, chunks,
            self.cache.scratch_slot, 0, self.mask_shape, torch.device("cpu"),
        )
        self.cache.plan = inputs.plan
        with torch.inference_mode():
            out = self.lm.model(
                input_ids=inputs.input_ids, position_ids=inputs.position_ids,
                attention_mask=inputs.attention_mask, cache=self.cache, use_cache=True,
                logits_to_keep=inputs.last,
            )
        for r, c in zip(rows, chunks):
            self.tokens[r] += c
            self.lengths[r] += len(c)
        return out.logits[:, 0].float()

    def check(self, rows: list[int], logits: torch.Tensor, chunks: list[list[int]]) -> None:
        for k, (r, c) in enumerate(zip(rows, chunks)):
            if not c:
                continue
            ref = reference_logits(self.lm, self.tokens[r])
            diff = (logits[k] - ref).abs().max().item()
            assert diff < TOL, f"row {r}: max logit diff {diff:.2e}"

    def backtrack(self, row: int, n: int) -> None:
        self.lengths[row] -= n
        del self.tokens[row][-n:]


def test_ragged_chunks_backtrack_and_refill_match_single_runs(lm: LoadedModel) -> None:
    g = torch.Generator().manual_seed(0)

    def toks(n: int) -> list[int]:
        return torch.randint(3, lm.vocab_size, (n,), generator=g).tolist()

    h = Harness(lm, rows=3)
    prompts = [toks(5), toks(11), toks(2)]
    rows = [0, 1, 2]
    h.check(rows, h.forward(rows, prompts, fresh=True), prompts)

    # Ragged decode: one sampled token, a forced chunk of 4, a forced chunk of 2;
    # capacity 8 forces the buffers to grow along the way.
    for step in range(6):
        chunks = [toks(1), toks(4 if step % 2 == 0 else 1), toks(2)]
        h.check(rows, h.forward(rows, chunks, fresh=False), chunks)

    # Backtrack row 1 by 5 tokens and row 2 by 1, then continue with ragged chunks.
    h.backtrack(1, 5)
    h.backtrack(2, 1)
    chunks = [toks(1), toks(3), toks(1)]
    h.check(rows, h.forward(rows, chunks, fresh=False), chunks)

    # Refill row 1 with a new prompt while rows 0 and 2 keep their state.
    h.lengths[1] = 0
    h.tokens[1] = []
    new_prompt = [toks(7)]
    h.check([1], h.forward([1], new_prompt, fresh=True), new_prompt)
    for _ in range(3):
        chunks = [toks(1), toks(2), toks(1)]
        h.check(rows, h.forward(rows, chunks, fresh=False), chunks)


def test_idle_row_inside_span_leaves_neighbours_exact(lm: LoadedModel) -> None:
    g = torch.Generator().manual_seed(1)
    h = Harness(lm, rows=3, capacity=64)
    prompts = [torch.randint(3, lm.vocab_size, (n,), generator=g).tolist() for n in (4, 6, 3)]
    h.forward([0, 1, 2], prompts, fresh=True)
    # Row 1 is idle (empty chunk): its padding queries must not disturb rows 0 and 2.
    for _ in range(3):
        chunks = [[5], [], [7, 8]]
        h.check([0, 1, 2], h.forward([0, 1, 2], chunks, fresh=False), chunks)
