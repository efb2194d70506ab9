"""The services behind a guest's `tokenizer` imports: the model's tokenizer and vocabulary.

`HostServices` is what the wasm host needs of them; `TokenizerServices` serves them from a
transformers tokenizer and llguidance's token table, shared by all sequences of one model.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any, Protocol

import numpy as np
import regex
import torch

from aici_cli.control.wasm.faults import clip


class HostServices(Protocol):
    """What the guest's `tokenizer` imports are served from (the model's tokenizer).

    Called from the thread that calls the guest, while the guest waits. Exceptions are
    contained: `tokens_matching`'s ValueError becomes the guest-visible `err(message)`;
    any other exception ends the guest with a `host_error` ControllerError.
    """

    def vocab_size(self) -> int: ...
    def eos_token(self) -> int: ...
    def tokenize(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def token_bytes(self, token: int) -> bytes: ...
    def tokens_matching(self, pattern: str) -> int: ...  # ValueError on a bad pattern
    def has_host_set(self, handle: int) -> bool: ...


class TokenizerServices:
    """The tokenizer and vocabulary services a guest imports, shared by all sequences of
    one model. `tokens_matching` scans the vocabulary once per pattern (about 120 ms at
    49k tokens) and keeps the packed bitmask on the host; guests get a handle.

    Patterns come from guests, so the scan is bounded: matching uses the `regex` module
    (re-compatible syntax, VERSION0) with a timeout, because `re` can backtrack for
    minutes on a pattern like `(a|a)+` while holding the GIL, which would stall every
    sequence; the timeout costs ~1.5 us per token. A pattern that fails (syntax or time)
    fails again at once. The cache of sets is capped at `cache_bytes` for the run (then
    new patterns get an error), and each sequence may add only `GuestLimits.max_patterns`.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token: int, lltok: Any,
                 scan_seconds: float = 5.0, cache_bytes: int = 128 << 20) -> None:
        self.tokenizer = tokenizer  # transformers tokenizer: tokenize / decode
        self.scan_seconds = scan_seconds  # per pattern, over the whole vocabulary
        self.cache_bytes = cache_bytes  # bitmasks and pattern text kept for the run
        self._vocab_size = vocab_size
        self._eos = eos_token
        self._lltok = lltok  # llguidance.LLTokenizer: per-token bytes, special tokens
        self._texts: list[str] | None = None
        self._sets: list[torch.Tensor] = []  # handle -> int32 [words]
        self._by_pattern: dict[str, int] = {}
        self._failed: dict[str, str] = {}  # pattern -> its error message
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def vocab_size(self) -> int:
        return self._vocab_size

    def eos_token(self) -> int:
        return self._eos

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False))

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < self._vocab_size:
            return b""
        return bytes(self._lltok.decode_bytes([token]))

    def tokens_matching(self, pattern: str) -> int:
        with self._lock:
            if pattern in self._by_pattern:
                return self._by_pattern[pattern]
            if pattern in self._failed:
                raise ValueError(self._failed[pattern])
            words = (self._vocab_size + 31) // 32
            cost = words * 4 + len(pattern.encode("utf-8", "replace"))
            if self._cached_bytes + cost > self.cache_bytes:
                raise ValueError(
                    f"the run's tokens-matching cache is full ({len(self._sets)} patterns, "
                    f"{self.cache_bytes:,} bytes); reuse patterns across sequences"
                )
            try:
                hits = self._scan(pattern, words)
            except ValueError as e:
                self._failed[pattern] = str(e)
                raise
            packed = np.packbits(hits, bitorder="little").view(np.int32)
            self._cached_bytes += cost
            self._sets.append(torch.from_numpy(packed.copy()))
            handle = len(self._sets) - 1
            self._by_pattern[pattern] = handle
            return handle

    def _scan(self, pattern: str, words: int) -> np.ndarray:
        """Which tokens fully match `pattern`; ValueError on bad syntax or past the budget."""
        shown = clip(repr(pattern), 200)
        try:
            re.compile(pattern)  # the contract's syntax is `re`'s: its errors are the ones
            rx = regex.compile(pattern, regex.VERSION0)
        except (re.error, regex.error) as e:
            raise ValueError(f"bad pattern {shown}: {e}") from None
        if self._texts is None:
            self._texts = [self.token_bytes(i).decode("utf-8", "replace")
                           for i in range(self._vocab_size)]
        hits = np.zeros(words * 32, dtype=bool)
        special = self._lltok.is_special_token
        fullmatch, now = rx.fullmatch, time.monotonic
        deadline = now() + self.scan_seconds
        try:
            hits[: self._vocab_size] = [
                fullmatch(t, timeout=deadline - now()) is not None and not special(i)
                for i, t in enumerate(self._texts)
            ]
        except TimeoutError:
            raise ValueError(
                f"pattern {shown} took more than {self.scan_seconds:g} s to match against "
                "the vocabulary (it backtracks too much)"
            ) from None
        return hits

    def has_host_set(self, handle: int) -> bool:
        return 0 <= handle < len(self._sets)

    def host_set(self, handle: int) -> torch.Tensor:
        return self._sets[handle]
