"""`TokenizerServices`: the host's vocabulary scans for `tokens-matching`, bounded in time
and in memory because their patterns come from guests."""

from __future__ import annotations

import time

import pytest

from aici_cli.control.wasm import TokenizerServices


class _LLTok:
    """The two llguidance tokenizer calls a scan uses, over a list of token texts."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return "".join(self.texts[t] for t in tokens).encode()

    def is_special_token(self, token: int) -> bool:
        return False


def test_a_backtracking_pattern_cannot_stall_the_host() -> None:
    texts = ["a" * 40 + "!", "b", "ab"]  # `re` would take hours on the first one
    services = TokenizerServices(None, len(texts), 0, _LLTok(texts), scan_seconds=0.3)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"took more than 0.3 s to match against the vocab"):
        services.tokens_matching("(a|a)+")
    assert time.perf_counter() - t0 < 5
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="took more than"):  # remembered, not rescanned
        services.tokens_matching("(a|a)+")
    assert time.perf_counter() - t0 < 0.1
    with pytest.raises(ValueError, match=r"bad pattern '\(': missing \), unterminated"):
        services.tokens_matching("(")
    handle = services.tokens_matching("[ab]+")
    assert services.host_set(handle).tolist() == [0b110]


def test_the_runs_pattern_cache_is_capped() -> None:
    texts = [chr(97 + i) for i in range(26)]  # a set costs its one 32-bit word plus its pattern
    services = TokenizerServices(None, len(texts), 0, _LLTok(texts), cache_bytes=15)
    assert services.tokens_matching("a") == 0
    assert services.tokens_matching("bb") == 1
    assert services.tokens_matching("a") == 0  # cached ones still answer
    with pytest.raises(ValueError, match=r"tokens-matching cache is full \(2 patterns"):
        services.tokens_matching("ccc")
