"""What every generate()-based peer shares: static left-padded batches and per-row counts.

All peers go through `generate_batch`, so the only thing that differs between them is the
constraint they plug into `model.generate()`; the counting rules (output tokens stop before
the first EOS/pad, row passes = decode steps x rows) are the same ones aici-batch reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

Messages = list[dict[str, str]]


@dataclass
class PeerRun:
    """Texts in input order plus the counts the orchestrator turns into figures.

    `row_passes` counts one per row per forward pass (a finished row idling in a static
    batch still costs its pass), the same unit as aici-batch's `row_forward_passes`.
    `constraint_failures` counts rows whose constraint could not be built or broke mid-row
    (generate() peers then let the row run free; aici-batch reports the line as an error).
    """

    texts: list[str]
    output_tokens: int = 0
    row_passes: int = 0
    batched_passes: int = 0
    wall_s: float = 0.0
    batches: int = 0  # generate() calls; aici-batch batches continuously (0)
    constraint_failures: int = 0
    dtype: str | None = None  # set by runners that load the model themselves (aici)
    notes: list[str] = field(default_factory=list)

    @classmethod
    def empty(cls, n: int) -> PeerRun:
        return cls(texts=[""] * n)

    def add(self, idx: Sequence[int], texts: Sequence[str], counts: Sequence[int],
            steps: int) -> None:
        """Record one generate() call over the input rows `idx` (texts land in input order)."""
        for i, text in zip(idx, texts):
            self.texts[i] = text
        self.output_tokens += sum(counts)
        self.row_passes += steps * len(counts)
        self.batched_passes += steps
        self.batches += 1


def static_batches(n: int, batch_size: int) -> Iterator[list[int]]:
    """Indices 0..n-1 in consecutive chunks: the static batching a plain generate() loop does."""
    for start in range(0, n, batch_size):
        yield list(range(start, min(start + batch_size, n)))


def render(tokenizer: Any, messages: Messages) -> str:
    """The chat-template rendering aici-batch itself uses, so every contender sees one prompt."""
    from aici_cli.models.tokenizer.chat import render_prompt

    return render_prompt(tokenizer, messages)


def stop_ids(model: Any, tokenizer: Any) -> set[int]:
    """EOS ids of the generation config plus the pad id: where a row's output ends."""
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if tokenizer.pad_token_id is not None:
        ids.add(tokenizer.pad_token_id)
    return ids


def generate_batch(model: Any, tokenizer: Any, messages: Sequence[Messages], max_tokens: int,
                   **generate_kwargs: Any) -> tuple[list[str], list[int], int]:
    """One greedy left-padded `generate()` call: (texts, output tokens per row, decode steps).

    Prompts are encoded without special tokens because the chat template already holds
    them (as aici-batch does). Decode steps = generated positions (the prefill produces the
    first token), i.e. batched forward passes.
    """
    import torch

    texts = [render(tokenizer, m) for m in messages]
    enc = tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")
    enc = {k: v.to(model.device) for k, v in enc.items()}
    eos = model.generation_config.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            **enc, do_sample=False, max_new_tokens=max_tokens,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
            **generate_kwargs,
        )
    gen = out[:, enc["input_ids"].shape[1]:].tolist()
    stops = stop_ids(model, tokenizer)
    rows, counts = [], []
    for tokens in gen:
        n = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        rows.append(tokenizer.decode(tokens[:n], skip_special_tokens=True))
        counts.append(n)
    return rows, counts, len(gen[0]) if gen else 0


class Timer:
    """Wall time of a `with` block, for the part of a peer's run that is measured."""

    def __enter__(self) -> Timer:
        self.start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start
