"""Host services (`aici_cli.control.wasm.HostServices`) over a made-up 100-token vocabulary,
for tests that run guests without a model."""

from __future__ import annotations

import re
import time


class FakeServices:
    """Token i decodes to f"<{i}>", and `tokenize` maps each character to its code % 100;
    token 99 makes `decode` raise (a host service that fails). `tokens_matching` checks
    the pattern's syntax (ValueError, as the real services do), records it and returns
    handles 1, 2, ...; it first spins for `matching_delay_s` of this thread's CPU time (a
    slow vocabulary scan: the guest's deadline counts CPU time, so the delay must be
    real work, not a sleep)."""

    def __init__(self, matching_delay_s: float = 0.0) -> None:
        self.patterns: list[str] = []  # the patterns scanned, in order; handle = index + 1
        self.matching_delay_s = matching_delay_s

    @property
    def handles(self) -> dict[int, str]:
        return {i + 1: pattern for i, pattern in enumerate(self.patterns)}

    def vocab_size(self) -> int:
        return 100

    def eos_token(self) -> int:
        return 2

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, tokens: list[int]) -> str:
        if 99 in tokens:
            raise RuntimeError("decode exploded")
        return "".join(f"<{t}>" for t in tokens)

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def tokens_matching(self, pattern: str) -> int:
        end = time.thread_time() + self.matching_delay_s
        while time.thread_time() < end:
            pass
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"bad pattern: {e}") from None
        self.patterns.append(pattern)
        return len(self.patterns)

    def has_host_set(self, handle: int) -> bool:
        return 0 < handle <= len(self.patterns)
