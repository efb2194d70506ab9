"""The per-row KV cache must give each row exactly the logits it would get alone.

Rows are ragged (different prompt lengths), feed chunks of different sizes in one pass
(a sampled token beside several forced ones), backtrack, and get refilled with a new
prompt while their neighbours keep decoding. After every pass each row's last logits are
compared with a cache-free forward pass over that row's whole token sequence.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from aici_cli.engine.forward.attention import install
from aici_cli.engine.forward.cache import RowCache
from aici_cli.engine.forward.inputs import AttentionLayout, build_inputs, forward
from aici_cli.models import LoadedModel

TOL = 1e-4


def reference_logits(lm: LoadedModel | SimpleNamespace, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        out = lm.model(input_ids=torch.tensor([tokens]))
    return out.logits[0, -1].float()


@pytest.fixture(scope="module")
def windowed() -> SimpleNamespace:
    """A tiny random Gemma 3: sliding-window layers (window 4) beside full ones, and four
    query heads sharing one key/value head."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=512,
    )
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Gemma3ForCausalLM(config).eval()
    return SimpleNamespace(model=model, vocab_size=config.vocab_size)


class Harness:
    """Drives RowCache + build_inputs the way the engine does, keeping each row's tokens."""

    def __init__(self, lm: LoadedModel | SimpleNamespace, rows: int, capacity: int = 8) -> None:
        self.lm = lm
        self.cache = RowCache(lm.model.config.num_hidden_layers, rows, capacity)
        self.tokens: list[list[int]] = [[] for _ in range(rows)]
        self.lengths = [0] * rows
        self.attention_layout = AttentionLayout.for_config(lm.model.config)
        install(lm.model)

    def forward(self, rows: list[int], chunks: list[list[int]], fresh: bool) -> torch.Tensor:
        """Feed `chunks[k]` to `rows[k]` in one packed pass over the span of `rows`; the
        logits [len(rows), V] of each row's last token."""
        if fresh:
            for r in rows:
                assert self.lengths[r] == 0
        span = list(range(min(rows), max(rows) + 1))
        by_row = dict(zip(rows, chunks))
        span_chunks = [by_row.get(r, []) for r in span]
        lengths = [self.lengths[r] for r in span]
        self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, span_chunks)))
        inputs = build_inputs(span[0], lengths, span_chunks, self.attention_layout,
                              torch.device("cpu"))
        with torch.inference_mode():
            logits = forward(self.lm.model, self.cache, inputs)
        for r, c in zip(rows, chunks):
            self.tokens[r] += c
            self.lengths[r] += len(c)
        return logits[[r - span[0] for r in rows]].float()

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


@pytest.mark.heavy
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


def test_new_prompt_rides_along_with_decoding_rows(lm: LoadedModel) -> None:
    """One pass holds a prompt (row 1, refilled), a sampled token and a forced chunk."""
    g = torch.Generator().manual_seed(2)

    def toks(n: int) -> list[int]:
        return torch.randint(3, lm.vocab_size, (n,), generator=g).tolist()

    h = Harness(lm, rows=3, capacity=32)
    prompts = [toks(6), toks(3), toks(9)]
    h.check([0, 1, 2], h.forward([0, 1, 2], prompts, fresh=True), prompts)
    for _ in range(2):
        chunks = [toks(1), toks(1), toks(3)]
        h.check([0, 1, 2], h.forward([0, 1, 2], chunks, fresh=False), chunks)
    h.lengths[1] = 0
    h.tokens[1] = []
    chunks = [toks(1), toks(12), toks(2)]
    h.check([0, 1, 2], h.forward([0, 1, 2], chunks, fresh=False), chunks)
    chunks = [[], toks(1), toks(1)]  # row 0 sits a pass out
    h.check([1, 2], h.forward([1, 2], chunks[1:], fresh=False), chunks[1:])


def test_sliding_window_and_grouped_heads_match_single_runs(windowed: SimpleNamespace) -> None:
    """Rows grow past the window (4) through single tokens, forced chunks longer than the
    window, a backtrack and a refill; every row still matches a cache-free run."""
    g = torch.Generator().manual_seed(3)

    def toks(n: int) -> list[int]:
        return torch.randint(0, windowed.vocab_size, (n,), generator=g).tolist()

    h = Harness(windowed, rows=3, capacity=8)
    prompts = [toks(2), toks(7), toks(5)]
    h.check([0, 1, 2], h.forward([0, 1, 2], prompts, fresh=True), prompts)
    for step in range(6):
        chunks = [toks(1), toks(6 if step == 2 else 1), toks(2 + step % 3)]
        h.check([0, 1, 2], h.forward([0, 1, 2], chunks, fresh=False), chunks)
    h.backtrack(2, 3)
    h.lengths[0] = 0
    h.tokens[0] = []
    chunks = [toks(10), toks(1), toks(3)]
    h.check([0, 1, 2], h.forward([0, 1, 2], chunks, fresh=False), chunks)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_cache_pages_become_resident_only_where_written() -> None:
    """64 rows x 4 layers of 2 x 512 KiB each (256 MiB of keys and values) take memory
    only for the one row a line writes; unwritten slots read as zeros."""
    cache = RowCache(num_layers=4, rows=64, capacity=1024)
    before = _resident_bytes()
    cache._allocate(torch.empty(1, 2, 1, 64))  # [rows, kv_heads, capacity, head_dim] each
    assert _resident_bytes() - before < 16 << 20
    for buf in (*cache.keys, *cache.values):
        buf[5] = 1.0  # one row: 512 KiB a buffer, 4 MiB in all
    grown = _resident_bytes() - before
    assert 4 << 20 <= grown < 24 << 20
    assert all(float(buf.sum()) == 2 * 1024 * 64 for buf in cache.keys)
    cache.ensure_capacity(1500)  # doubled; the written row copied, the rest still unmapped
    assert cache.keys[0].shape == (64, 2, 2048, 64) and float(cache.keys[0][5, :, :1024].min()) == 1
    assert float(cache.keys[0][:, :, 1024:].abs().sum()) == 0
