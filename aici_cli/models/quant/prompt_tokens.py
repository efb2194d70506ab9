"""Which tokens of the current eager pass are prompt tokens: on a 16-bit CPU run whose
int4 layers have dense copies (`dense_copies`), those tokens, and only those, run on the
copies, in GEMMs of exactly `TILE_ROWS` rows.

A rule by token, not by pass: a dense GEMM rounds a row by the shape of the whole call
(oneDNN picks its blocking by the row count: a bf16 row of 1536 x 576 rounds otherwise in
a GEMM of 5, 16 or 32 rows than alone), and a pass's width follows the lines that share
it. So a token's kernel is set by what it is in its own line (a prompt token, or one the
line generated: a sampled token, a fast-forward chunk, a draft, all on the int kernels),
and a prompt token's GEMM has one shape: the pass's prompt tokens gathered, padded with
zero rows to whole tiles, each tile one call (a row's bits in a tile do not depend on the
other rows or its place there). A prompt token then has the same bits whether it was fed
alone, beside other lines' prompts, after a prefix-cache hit or in another chunk.

Tiles of 128 rows, measured on the 2-core Xeon with AMX (bf16, one layer of the default
model, ms): 1536 x 576 at 1,024 prompt tokens 1.39 against 3.63 on the int kernel (one
GEMM of all the rows: 0.74); at 200 tokens 0.34 against 0.70; at 24 tokens 0.13 against
0.09.

Thread-local: a pass sets it around its forward (`engine/forward/passes.py`); another
thread's passes (a step builder's) see their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# The rows of every GEMM a prompt token's dense copy runs in.
TILE_ROWS = 128

_local = threading.local()


@dataclass(frozen=True)
class PromptTokens:
    """The pass's prompt tokens: `index` [P] int64, their positions among its `total`
    packed tokens (P >= 1); `tiled` False: in one GEMM of P rows (`--wide-prefill`)."""

    index: torch.Tensor
    total: int
    tiled: bool = True

    def run(self, x: torch.Tensor, dense: torch.Tensor, others: object) -> torch.Tensor:
        """x [total, K] -> [total, N]: the prompt tokens' rows on `dense` [N, K] in tiles,
        the rest through `others` (a callable [rows, K] -> [rows, N], the int kernel)."""
        gemm = tiled_linear if self.tiled else F.linear
        if self.index.shape[0] == self.total:
            return gemm(x, dense)
        y = x.new_empty(self.total, dense.shape[0])
        y[self.index] = gemm(x[self.index], dense)
        rest = torch.ones(self.total, dtype=torch.bool, device=x.device)
        rest[self.index] = False
        y[rest] = others(x[rest])  # type: ignore[operator]
        return y


def tiled_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [P, K] @ weight^T in GEMMs of exactly TILE_ROWS rows (the last padded with zero
    rows): every row's bits are those of one kernel of one shape."""
    rows = x.shape[0]
    padded = -(-rows // TILE_ROWS) * TILE_ROWS
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = torch.cat([F.linear(x[i : i + TILE_ROWS], weight)
                     for i in range(0, padded, TILE_ROWS)])
    return out[:rows]


def moved_row(weight: torch.Tensor) -> str | None:
    """Where this machine's dense GEMM gives a row of a tile other bits by its place or
    its neighbours (for `weight` [N, K], as a tile runs it): None where it does not, else
    which row moved. oneDNN's AMX and AVX-512 kernels keep a row's bits in a GEMM of one
    shape; a BLAS whose micro-kernel takes rows in blocks that do not divide the tile (6
    on some AVX2 kernels) would round the last rows otherwise. Checked before any copy is
    made (`dense_copies`), so that prompt tokens on the copies are row-independent on
    every machine that takes them: a few tiles' GEMMs."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(TILE_ROWS + 3, weight.shape[1], generator=generator).to(weight.dtype)
    whole = tiled_linear(x, weight)  # two tiles, the second padded
    shifted = tiled_linear(torch.roll(x, 5, dims=0), weight)
    others = torch.randn_like(x, dtype=torch.float32).to(weight.dtype)
    for p in (0, 1, 2, 5, TILE_ROWS // 2, TILE_ROWS - 2, TILE_ROWS - 1, TILE_ROWS):
        alone = tiled_linear(x[p : p + 1], weight)[0]
        beside = others.clone()
        beside[p] = x[p]
        if not (torch.equal(whole[p], alone)
                and torch.equal(shifted[(p + 5) % x.shape[0]], alone)
                and torch.equal(tiled_linear(beside, weight)[p], alone)):
            return f"row {p} of {TILE_ROWS}"
    return None


def current() -> PromptTokens | None:
    """The prompt tokens of the pass running on this thread (None: none, or no pass)."""
    return getattr(_local, "tokens", None)


@contextmanager
def feeding(counts: list[tuple[int, int]], total: int, device: torch.device,
            tiled: bool = True) -> Iterator[None]:
    """Within the block, a pass of `total` packed tokens whose prompt tokens are the
    `(start, n)` runs of `counts` (a row's first n tokens from position start); `tiled`
    False: they run in one GEMM (`--wide-prefill`)."""
    positions = [p for start, n in counts for p in range(start, start + n)]
    previous = current()
    _local.tokens = (PromptTokens(torch.tensor(positions, dtype=torch.long, device=device),
                                  total, tiled) if positions else None)
    try:
        yield
    finally:
        _local.tokens = previous
