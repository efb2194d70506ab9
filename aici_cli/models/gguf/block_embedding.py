"""An input embedding kept as the GGUF's own blocks, its rows dequantised as looked up.

A lookup reads a few rows of the table, so a quantised run need not keep the table
dense: the conversion stores the GGUF's Q8_0 (or Q4_0/Q4_1, or Q4_K's sub-blocks with
float32 scales: `kquant`) blocks once (`tensors`;
the default model's: 30 MB against 57 MB in bfloat16), and each looked-up row is
dequantised as gguf does it (float32), rounded to bfloat16, then cast to the run's dtype:
exactly the rows of the bfloat16 table a dense copy holds (`blocks` computes
gguf's values bit for bit; casting a bfloat16 to a wider float is exact, and to float16
is what a float16 copy of that table would hold).
"""

from __future__ import annotations

import torch

from aici_cli.models.gguf.blocks import BLOCK
from aici_cli.models.gguf.matrices import STORED_DTYPE


class BlockEmbedding(torch.nn.Module):
    """`codes`: [V, H] int8 (Q8_0) or [V, H/2] uint8 (4-bit, column 2c in the low
    nibble); `d`, and for 4-bit `m`, [V, H/32] float16 or float32: row v is codes * d
    (+ m), computed in float32."""

    codes: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    def __init__(self, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = d.shape[0], d.shape[1] * BLOCK
        self.out_dtype = dtype
        self.register_buffer("codes", codes)
        self.register_buffer("d", d)
        self.register_buffer("m", m)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        d = self.d[flat].float().repeat_interleave(BLOCK, dim=1)
        codes = self.codes[flat]
        if self.m is None:
            rows = codes.float() * d
        else:  # two codes a byte: interleave the nibbles back into column order
            nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(len(flat), -1)
            rows = nibbles.float() * d + self.m[flat].float().repeat_interleave(BLOCK, dim=1)
        rows = rows.to(STORED_DTYPE).to(self.out_dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)
