"""A wasm controller seen from the engine: the per-step contract on top of a `Runner`.

The guest answers each `mid-process` call with an action. `sample` sets the token set for
the next token; `generate` hands a whole segment to the host, which enforces it with the
same llguidance machinery as the built-in controllers (fast-forward included) and calls the
guest again only when the segment ends; `splice` rewrites the tail and the guest is asked
again at once; `stop` ends the sequence. A chain of splices and segment starts collapses
into one `Directive` for the engine.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import regex
import torch

from aici_cli.control.actions import (
    Action,
    Generate,
    Grammar,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
)
from aici_cli.control.base import Directive
from aici_cli.control.constraint import Constraint
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.wasm import ControllerComponent, Runner, clip
from aici_cli.errors import ControllerError, GrammarError

# Most tokens one chain of splices may force before the guest lets the model sample. Far
# past any context window this engine runs; it bounds the host memory and the quadratic
# cost of composing a chain that a guest could otherwise splice 10,000 times.
MAX_CHAIN_TOKENS = 1 << 18


def compose(a: Directive, b: Directive) -> Directive:
    """The directive equal to applying `a`, then `b`."""
    taken = min(b.backtrack, len(a.forced))
    return Directive(
        forced=a.forced[: len(a.forced) - taken] + b.forced,
        backtrack=a.backtrack + b.backtrack - taken,
        stop=a.stop or b.stop,
    )


class TokenizerServices:
    """The tokenizer and vocabulary services a guest imports, shared by all sequences of
    one model. `tokens_matching` scans the vocabulary once per pattern (about 120 ms at
    49k tokens) and keeps the packed bitmask on the host; guests get a handle.

    Patterns come from guests, so the scan is bounded: matching uses the `regex` module
    (re-compatible syntax, VERSION0) with a timeout, because `re` can backtrack for
    minutes on a pattern like `(a|a)+` while holding the GIL, which would stall every
    sequence; the timeout costs ~1.5 us per token. A pattern that fails (syntax or time)
    fails again at once. The cache of sets is capped at `cache_bytes` for the run (then
    new patterns get an error), and each sequence may add only `Limits.max_patterns`.
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


@dataclass
class SegmentState:
    spec: Segment
    grammar: GrammarController | None
    tokens: list[int] = field(default_factory=list)
    checked: int = 0  # characters of the segment text already searched for stop strings


def grammar_constraint(g: Grammar) -> Constraint:
    if g.kind == "json-schema":
        try:
            return Constraint("json_schema", json.loads(str(g.value)))
        except ValueError as e:
            raise ControllerError("bad_action", f"segment JSON schema is not JSON: {e}") from None
    if g.kind == "regex":
        return Constraint("regex", str(g.value))
    if g.kind == "lark":
        return Constraint("lark", str(g.value))
    return Constraint("choice", list(g.value))


class WasmController:
    """One sequence's wasm controller; implements `aici_cli.control.base.Controller`."""

    def __init__(self, component: ControllerComponent, arg: str, services: TokenizerServices,
                 compiler: GrammarCompiler, fast_forward: bool = True,
                 call_times: list[float] | None = None) -> None:
        self.component = component
        self.arg = arg
        self.services = services
        self.compiler = compiler
        self.fast_forward = fast_forward
        self.runner: Runner | None = None
        # Shared by the run's controllers: ms of every mid-process call, for p50/p99.
        self.call_times = call_times if call_times is not None else []
        self.token_set: TokenSet = TokenSet("all")
        self.segment: SegmentState | None = None
        self.segment_ms = 0.0  # host time spent running segments (masks excluded)
        self.generated = 0  # output tokens so far, as the engine will hold them
        self._pending: StepInput | None = None  # sampled tokens the guest has not seen yet

    # --- the engine's contract ---------------------------------------------------------

    def start(self, prompt: Sequence[int]) -> Directive:
        self.runner = self.component.instantiate(self.arg, list(prompt), self.services)
        return self._follow(self._call(StepInput()), Directive())

    def advance(self, tokens: Sequence[int]) -> Directive:
        self.generated += len(tokens)
        seg = self.segment
        if seg is None:
            # The guest's answer about these tokens is only needed for the next mask, so
            # the call waits for `fill_mask`, which runs beside the next forward pass.
            self._pending = StepInput(tokens=tuple(tokens))
            return Directive()
        t0 = time.perf_counter()
        seg.tokens += tokens
        d = Directive()
        if seg.grammar is not None:
            d = seg.grammar.advance(tokens)
            seg.tokens += d.forced
        ended = d.stop or len(seg.tokens) >= seg.spec.max_tokens or self._hit_stop(seg)
        self.segment_ms += (time.perf_counter() - t0) * 1000.0
        self.generated += len(d.forced)
        if not ended:
            return d
        return self._end_segment(Directive(forced=d.forced))

    def valid_prefix(self, tokens: list[int]) -> int:
        """Draft tokens the host can vouch for: inside a grammar segment, those its
        grammar accepts (the segment's end is its grammar's end); anywhere the guest
        decides next, none."""
        if self._pending is not None or self.segment is None or self.segment.grammar is None:
            return 0
        return self.segment.grammar.valid_prefix(tokens)

    def on_eos(self) -> Directive | None:
        """End-of-sequence inside a segment ends the segment, not the sequence."""
        if self.segment is None:
            return None
        grammar = self.segment.grammar
        if grammar is not None:
            grammar.on_eos()  # raises if the segment's matcher failed: not a normal end
        return self._end_segment(Directive())

    def fill_mask(self, out: torch.Tensor) -> bool | Directive:
        if self._pending is not None:
            inp, self._pending = self._pending, None
            directive = self._follow(self._call(inp), Directive())
            if directive != Directive():
                return directive  # a splice or stop: the engine applies it instead
        if self.segment is not None:
            grammar = self.segment.grammar
            return grammar.fill_mask(out) if grammar is not None else False
        ts = self.token_set
        if ts.kind == "all":
            return False
        if ts.kind == "bitmask":
            out.copy_(torch.tensor(np.asarray(ts.tokens, dtype=np.uint32).view(np.int32)))
            return True
        if ts.kind in ("host-set", "not-host-set"):
            words = self.services.host_set(ts.handle)
            out.copy_(words if ts.kind == "host-set" else ~words)
            return True
        bits = np.zeros(out.numel() * 32, dtype=bool)
        bits[list(ts.tokens)] = True
        if ts.kind == "deny":
            bits = ~bits
        out.copy_(torch.from_numpy(np.packbits(bits, bitorder="little").view(np.int32)))
        return True

    @property
    def matcher(self) -> Any:
        """The segment's llguidance matcher, so the engine can fill it with the others."""
        seg = self.segment
        return seg.grammar.matcher if seg is not None and seg.grammar is not None else None

    def report(self, text: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.runner is not None:
            if self.runner.logs:
                fields["logs"] = "\n".join(self.runner.logs)
            if self.runner.outputs:
                fields["outputs"] = dict(self.runner.outputs)
        return fields

    @property
    def guest_ms(self) -> float:
        return self.runner.guest_ms if self.runner is not None else 0.0

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    # --- internals ---------------------------------------------------------------------

    def _call(self, inp: StepInput) -> Action:
        assert self.runner is not None
        t0 = time.perf_counter()
        try:
            return self.runner.mid_process(inp)
        finally:
            self.call_times.append((time.perf_counter() - t0) * 1000.0)

    def _follow(self, action: Action, acc: Directive) -> Directive:
        """Apply actions until one needs the model (sample or a running segment)."""
        for _ in range(10_000):  # a guest that only splices would otherwise never yield
            if isinstance(action, Stop):
                return compose(acc, Directive(stop=True))
            if isinstance(action, Sample):
                self.token_set = action.tokens
                return acc
            if isinstance(action, Splice):
                if len(acc.forced) + len(action.ff_tokens) > MAX_CHAIN_TOKENS:
                    raise ControllerError(
                        "bad_action",
                        f"splices forced more than {MAX_CHAIN_TOKENS:,} tokens without "
                        "sampling",
                    )
                if action.backtrack > self.generated:
                    raise ControllerError(
                        "bad_backtrack",
                        f"splice backtracks {action.backtrack} tokens but only "
                        f"{self.generated} were generated (the prompt cannot be rewritten)",
                    )
                self.generated += len(action.ff_tokens) - action.backtrack
                step = Directive(forced=action.ff_tokens, backtrack=action.backtrack)
                acc = compose(acc, step)
                action = self._call(StepInput(backtrack=action.backtrack,
                                              tokens=action.ff_tokens))
                continue
            if isinstance(action, Generate):
                d = self._begin_segment(action.segment)
                self.generated += len(d.forced)
                acc = compose(acc, Directive(forced=d.forced))
                if self.segment is not None:
                    return acc
                action = self._segment_done_action(d.forced)
                continue
            raise ControllerError("bad_action", f"unknown action {action!r}")
        raise ControllerError("bad_action", "controller spliced 10000 times without sampling")

    def _begin_segment(self, spec: Segment) -> Directive:
        t0 = time.perf_counter()
        grammar = None
        if spec.grammar is not None:
            try:
                compiled = self.compiler.compile(grammar_constraint(spec.grammar))
            except GrammarError as e:
                raise ControllerError(
                    "bad_action", f"segment grammar: {clip(e.message, 1000)}"
                ) from None
            grammar = GrammarController(compiled, self.fast_forward)
        self.segment = SegmentState(spec, grammar)
        d = grammar.start([]) if grammar is not None else Directive()
        self.segment.tokens += d.forced
        self.segment_ms += (time.perf_counter() - t0) * 1000.0
        if d.stop or len(self.segment.tokens) >= spec.max_tokens:
            self.segment = None  # finished on forced tokens alone
        return d

    def _segment_done_action(self, tokens: Sequence[int]) -> Action:
        text = self.services.decode(list(tokens))
        return self._call(StepInput(tokens=tuple(tokens), segment_text=text))

    def _end_segment(self, acc: Directive) -> Directive:
        seg = self.segment
        assert seg is not None
        self.segment = None
        text = self.services.decode(seg.tokens)
        action = self._call(StepInput(tokens=tuple(seg.tokens), segment_text=text))
        return self._follow(action, acc)

    def _hit_stop(self, seg: SegmentState) -> bool:
        if not seg.spec.stop:
            return False
        text = self.services.decode(seg.tokens)
        longest = max(len(s) for s in seg.spec.stop)
        start = max(0, seg.checked - longest + 1)
        seg.checked = len(text)
        return any(text.find(s, start) >= 0 for s in seg.spec.stop)
