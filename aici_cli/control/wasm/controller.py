"""A wasm controller seen from the engine: the per-step contract on top of a `GuestInstance`.

The guest answers each `mid-process` call with an action. `sample` sets the token set for
the next token; `generate` hands a whole segment to the host, which enforces it with the
same llguidance machinery as the built-in controllers (fast-forward included) and calls the
guest again only when the segment ends; `splice` rewrites the tail and the guest is asked
again at once; `stop` ends the sequence; `fork(n)` (contract 0.2.0) ends the chain with
a `Directive(fork=n)`: the engine then asks `fork` for the other branches' controllers
(new guests brought to this one's state by replay, see `instance.py`) and `enter_branch`
of every branch, which tells the guest its index. A chain of splices and segment starts
collapses into one `Directive` for the engine.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np
import torch

from aici_cli.control.actions import (
    Action,
    Fork,
    Generate,
    Sample,
    Segment,
    Splice,
    StepInput,
    Stop,
    TokenSet,
)
from aici_cli.control.base import Controller, ControllerBase, Directive
from aici_cli.control.call_trace import CallTrace
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.guest_tools import NO_TOOLS, GuestTools
from aici_cli.control.line_scope import LineScope
from aici_cli.control.stop_strings import find_stop
from aici_cli.control.wasm.component import ControllerComponent
from aici_cli.control.wasm.faults import clip
from aici_cli.control.wasm.instance import GuestInstance
from aici_cli.control.wasm.services import TokenizerServices
from aici_cli.core.errors import ControllerError, GrammarError

# Most tokens one chain of splices may force before the guest lets the model sample. Far
# past any context window this engine runs; it bounds the host memory and the quadratic
# cost of composing a chain that a guest could otherwise splice 10,000 times.
MAX_CHAIN_TOKENS = 1 << 18


def compose(a: Directive, b: Directive) -> Directive:
    """The directive equal to applying `a`, then `b`."""
    taken = min(b.backtrack, len(a.ff_tokens))
    return Directive(
        ff_tokens=a.ff_tokens[: len(a.ff_tokens) - taken] + b.ff_tokens,
        backtrack=a.backtrack + b.backtrack - taken,
        stop=a.stop or b.stop,
        fork=b.fork,
    )


@dataclass
class SegmentState:
    spec: Segment
    grammar: GrammarController | None
    tokens: list[int] = field(default_factory=list)
    checked: int = 0  # characters of the segment text already searched for stop strings


class WasmController(ControllerBase):
    """One sequence's wasm controller; implements `aici_cli.control.base.Controller`."""

    def __init__(self, component: ControllerComponent, arg: str, services: TokenizerServices,
                 compiler: GrammarCompiler, fast_forward: bool = True,
                 call_times: list[float] | None = None, tools: GuestTools = NO_TOOLS) -> None:
        self.component = component
        self.arg = arg
        self.services = services
        self.tools = tools  # what the guest's aici:tools calls reach (its line's)
        self.compiler = compiler
        self.fast_forward = fast_forward
        self.guest: GuestInstance | None = None
        # Shared by the run's controllers: ms of every mid-process call, for p50/p99.
        self.call_times = call_times if call_times is not None else []
        self.token_set: TokenSet = TokenSet("all")
        self.segment: SegmentState | None = None
        self.segment_ms = 0.0  # host time spent running segments (masks excluded)
        self.generated = 0  # output tokens so far, as the engine will hold them
        # Output tokens before the latest fork (None: no fork yet): no backtrack reaches
        # past it, the tokens before it are shared with the other branches.
        self.floor: int | None = None
        self.replay_ms = 0.0  # bringing this branch's guest to its fork point (replay)
        self.scope: LineScope | None = None  # what the line's sequences share
        self._pending: StepInput | None = None  # sampled tokens the guest has not seen yet
        self.trace: CallTrace | None = None  # a tracer's: told of every guest call

    # --- the engine's contract ---------------------------------------------------------

    def join_line(self, scope: LineScope) -> None:
        self.scope = scope

    def start(self, prompt: Sequence[int]) -> Directive:
        t0 = time.perf_counter()
        self.guest = self.component.instantiate(self.arg, list(prompt), self.services,
                                                self.scope, self.tools)
        if self.trace is not None:
            self.trace("start", t0, time.perf_counter())
        return self._follow(self._call(StepInput()), Directive())

    def fork(self, n: int) -> list[Controller]:
        """Branches 1..n-1: each a new guest replayed to this one's state (see
        `GuestInstance.replica`); this controller continues as branch 0."""
        assert self.guest is not None
        branches: list[Controller] = []
        try:
            for _ in range(n - 1):
                t0 = time.perf_counter()
                branch = WasmController(self.component, self.arg, self.services,
                                        self.compiler, self.fast_forward, self.call_times,
                                        self.tools)
                branch.scope = self.scope
                branch.guest = self.guest.replica()
                branch.generated = branch.floor = self.generated
                t1 = time.perf_counter()
                branch.replay_ms = (t1 - t0) * 1000.0
                branch.trace = self.trace
                if self.trace is not None:
                    self.trace("fork replay", t0, t1, {"aici.fork.branches": n})
                branches.append(branch)
        except ControllerError:
            for made in branches:
                made.close()
            raise
        self.floor = self.generated
        return branches

    def enter_branch(self, index: int) -> Directive:
        return self._follow(self._call(StepInput(branch=index)), Directive())

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
            seg.tokens += d.ff_tokens
        ended = d.stop or len(seg.tokens) >= seg.spec.max_tokens or self._hit_stop(seg)
        self.segment_ms += (time.perf_counter() - t0) * 1000.0
        self.generated += len(d.ff_tokens)
        if not ended:
            return d
        return self._end_segment(Directive(ff_tokens=d.ff_tokens))

    def valid_prefix(self, tokens: Sequence[int]) -> int:
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

    def matcher(self) -> llguidance.LLMatcher | None:
        """The segment's llguidance matcher, so the engine can fill it with the others."""
        seg = self.segment
        return seg.grammar.matcher() if seg is not None and seg.grammar is not None else None

    def matcher_fault(self) -> ControllerError:
        seg = self.segment
        if seg is None or seg.grammar is None:
            return super().matcher_fault()
        return seg.grammar.matcher_fault()

    def report(self, text: str) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.guest is not None:
            if self.guest.logs:
                fields["logs"] = "\n".join(self.guest.logs)
            if self.guest.outputs:
                fields["outputs"] = dict(self.guest.outputs)
        return fields

    def stats(self) -> dict[str, float | bool | str]:
        """Where `controller_ms` went: inside the guest, and running its segments."""
        guest_ms = self.guest.guest_ms if self.guest is not None else 0.0
        out: dict[str, float | bool | str] = {"guest_ms": guest_ms, "segment_ms": self.segment_ms}
        if self.replay_ms:
            out["replay_ms"] = self.replay_ms
        return out

    def close(self) -> None:
        if self.guest is not None:
            self.guest.close()

    # --- internals ---------------------------------------------------------------------

    def _call(self, inp: StepInput) -> Action:
        assert self.guest is not None
        t0 = time.perf_counter()
        try:
            return self.guest.mid_process(inp)
        finally:
            t1 = time.perf_counter()
            self.call_times.append((t1 - t0) * 1000.0)
            if self.trace is not None:
                self.trace("mid-process", t0, t1)

    def _follow(self, action: Action, acc: Directive) -> Directive:
        """Apply actions until one needs the model (sample or a running segment)."""
        for _ in range(10_000):  # a guest that only splices would otherwise never yield
            if isinstance(action, Stop):
                return compose(acc, Directive(stop=True))
            if isinstance(action, Sample):
                self.token_set = action.tokens
                return acc
            if isinstance(action, Fork):
                return compose(acc, Directive(fork=action.branches))
            if isinstance(action, Splice):
                if len(acc.ff_tokens) + len(action.ff_tokens) > MAX_CHAIN_TOKENS:
                    raise ControllerError(
                        "bad_action",
                        f"splices forced more than {MAX_CHAIN_TOKENS:,} tokens without "
                        "sampling",
                    )
                if self.floor is not None and action.backtrack > self.generated - self.floor:
                    raise ControllerError(
                        "bad_action",
                        f"splice backtracks {action.backtrack} tokens past the fork point: "
                        f"only {self.generated - self.floor} were generated since the fork "
                        "(a branch shares the tokens before it)",
                    )
                if action.backtrack > self.generated:
                    raise ControllerError(
                        "bad_backtrack",
                        f"splice backtracks {action.backtrack} tokens but only "
                        f"{self.generated} were generated (the prompt cannot be rewritten)",
                    )
                self.generated += len(action.ff_tokens) - action.backtrack
                step = Directive(ff_tokens=action.ff_tokens, backtrack=action.backtrack)
                acc = compose(acc, step)
                action = self._call(StepInput(backtrack=action.backtrack,
                                              tokens=action.ff_tokens))
                continue
            if isinstance(action, Generate):
                d = self._begin_segment(action.segment)
                self.generated += len(d.ff_tokens)
                acc = compose(acc, Directive(ff_tokens=d.ff_tokens))
                if self.segment is not None:
                    return acc
                action = self._segment_done_action(d.ff_tokens)
                continue
            raise ControllerError("bad_action", f"unknown action {action!r}")
        raise ControllerError("bad_action", "controller spliced 10000 times without sampling")

    def _begin_segment(self, spec: Segment) -> Directive:
        t0 = time.perf_counter()
        grammar = None
        if spec.grammar is not None:
            try:
                compiled = self.compiler.compile(spec.grammar)
            except GrammarError as e:
                raise ControllerError(
                    "bad_action", f"segment grammar: {clip(e.message, 1000)}"
                ) from None
            finally:
                if self.trace is not None:
                    self.trace("grammar compile", t0, time.perf_counter(),
                               {"aici.grammar.kind": spec.grammar.kind})
            # No keyword guard: its backtracks would not reach the segment's own count.
            grammar = GrammarController(compiled, self.fast_forward, keywords=False)
        self.segment = SegmentState(spec, grammar)
        d = grammar.start([]) if grammar is not None else Directive()
        self.segment.tokens += d.ff_tokens
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
        hit = find_stop(text, seg.spec.stop, seg.checked)
        seg.checked = len(text)
        return hit is not None
