"""`@controller`, the `Context` a controller sees, and the per-token `TokenController`.

Two styles, one registration:
- a generator function `def f(ctx): ... x = yield gen(...) ...` (a program of segments);
- a `TokenController` subclass whose `step` decides after every host step.

`@controller` checks the target when the module is imported, which for a built component
is build time (componentize-py imports the module while it snapshots it), so mistakes
surface as clear build errors rather than as failing sequences.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from ._actions import Action
from ._host import Host, to_json


class Context:
    """What one sequence's controller knows, plus the host's tokenizer.

    Invariant: `tokens` mirrors the host's output tokens (after the prompt) as reported in
    each step; the session applies every step's backtrack and tokens before the controller
    runs. Tokenizer methods are host calls (cheap, but not free: tens of microseconds).
    """

    def __init__(self, host: Host, arg: str, prompt: Sequence[int]) -> None:
        self._host = host
        self.arg: str = arg
        self.prompt: tuple[int, ...] = tuple(prompt)
        self._tokens: list[int] = []
        self.last_tokens: tuple[int, ...] = ()  # appended by the latest step
        self.last_backtrack: int = 0  # removed by the latest step
        self.segment_text: str | None = None  # the latest step ended a segment
        # After a fork: this branch's index at the latest fork, and at every fork so far.
        self.branch: int | None = None
        self.branch_path: tuple[int, ...] = ()
        self._arg_json: Any = None
        self._arg_parsed = False
        self._eos: int | None = None
        self._vocab_size: int | None = None

    @property
    def tokens(self) -> Sequence[int]:
        """The output tokens so far (read-only view; do not modify)."""
        return self._tokens

    def arg_json(self) -> Any:
        """`arg` parsed as JSON (parsed once); an empty arg is `{}`."""
        if not self._arg_parsed:
            text = self.arg.strip()
            try:
                self._arg_json = json.loads(text) if text else {}
            except ValueError as exc:
                raise ValueError(
                    f"the controller arg is not JSON ({exc}): {self.arg[:80]!r}"
                ) from None
            self._arg_parsed = True
        return self._arg_json

    @property
    def eos_token(self) -> int:
        if self._eos is None:
            self._eos = self._host.eos_token()
        return self._eos

    @property
    def vocab_size(self) -> int:
        if self._vocab_size is None:
            self._vocab_size = self._host.vocab_size()
        return self._vocab_size

    @property
    def at_eos(self) -> bool:
        """The last output token is end-of-sequence (e.g. a segment ended early)."""
        return bool(self._tokens) and self._tokens[-1] == self.eos_token

    def tokenize(self, text: str) -> list[int]:
        return self._host.tokenize(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self._host.decode(list(tokens))

    def token_bytes(self, token: int) -> bytes:
        return self._host.token_bytes(token)

    def text(self) -> str:
        """The output so far, decoded (one host call over all output tokens)."""
        return self._host.decode(list(self._tokens))

    def log(self, message: str) -> None:
        self._host.log(str(message))

    def set_output(self, key: str, value: Any) -> None:
        self._host.set_output(key, to_json(value, key))

    def set_line_output(self, key: str, value: Any) -> None:
        self._host.set_line_output(key, to_json(value, key))

    def _apply(self, backtrack: int, tokens: Sequence[int], segment_text: str | None,
               branch: int | None = None) -> None:
        if backtrack > len(self._tokens):
            raise ValueError(
                f"the host removed {backtrack} tokens but only {len(self._tokens)} were generated"
            )
        if backtrack:
            del self._tokens[-backtrack:]
        self._tokens.extend(tokens)
        self.last_backtrack = backtrack
        self.last_tokens = tuple(tokens)
        self.segment_text = segment_text
        if branch is not None:
            self.branch = branch
            self.branch_path += (branch,)


class TokenController:
    """Base class for controllers that decide after every host step.

    One instance per sequence, made with no arguments. `start` runs once, before the
    first `step`; `step` runs on every host call (the first with no tokens) and returns
    an action. Prefer segments (`gen`) where they fit: each `step` is a wasm round trip.
    """

    def start(self, ctx: Context) -> None:
        """Set up per-sequence state (read `ctx.arg_json()` here)."""

    def step(self, ctx: Context, new_tokens: Sequence[int]) -> Action:
        """`new_tokens` were appended since the previous step (after `ctx.last_backtrack`
        were removed). Return `sample(...)`, `gen(...)`, `fixed(...)`, `fork(n)`, ... or
        `stop()`."""
        raise NotImplementedError

    def on_fork(self, ctx: Context, branch: int) -> Action:
        """After `step` returned `fork(n)`: called once in each branch, in place of the
        next `step`, with its index 0..n-1 (also in `ctx.branch`). The instance is the
        one that forked, in its state at the fork, in every branch. By default: `step`
        with no new tokens."""
        return self.step(ctx, ())


class ControllerSpec:
    """A checked controller: a generator function or a `TokenController` subclass.

    Calling it calls the target, so a decorated function or class still works as before.
    """

    def __init__(self, target: Callable[..., Any], kind: str) -> None:
        self.target = target
        self.kind = kind  # "generator" or "token"
        self.name: str = target.__name__
        self.module: str = target.__module__
        self.__doc__ = target.__doc__
        self.__wrapped__ = target

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<controller {self.module}.{self.name} ({self.kind})>"


_USAGE = (
    "decorate a generator function `def f(ctx): ... yield gen(...)` "
    "or a TokenController subclass with @controller"
)


def controller(target: Any = None) -> ControllerSpec:
    """Register a controller; checks the target now (at import, i.e. at build time).

    Raises `TypeError` naming the problem: not a generator function (no `yield`), async,
    wrong parameters, a class that is not a `TokenController` or has no `step`.
    """
    if target is None:
        raise TypeError("use @controller without parentheses")
    if isinstance(target, ControllerSpec):
        raise TypeError(f"{target.name!r} is decorated with @controller twice")
    if inspect.isclass(target):
        return ControllerSpec(_check_class(target), "token")
    if inspect.iscoroutinefunction(target) or inspect.isasyncgenfunction(target):
        raise TypeError(
            f"@controller function {target.__name__!r} is async: "
            "controllers are plain generator functions"
        )
    if inspect.isfunction(target):
        return ControllerSpec(_check_function(target), "generator")
    raise TypeError(f"@controller got {type(target).__name__} {target!r}: {_USAGE}")


def _check_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    name = fn.__name__
    if not inspect.isgeneratorfunction(fn):
        raise TypeError(
            f"@controller function {name!r} is not a generator function: it must `yield` "
            "actions (fixed(...), gen(...), sample(...)); for a controller that decides "
            "every token, subclass TokenController"
        )
    try:
        inspect.signature(fn).bind(None)
    except TypeError:
        raise TypeError(
            f"@controller function {name!r} must take one argument, the Context: "
            f"def {fn.__name__}(ctx): ..."
        ) from None
    return fn


def _check_class(cls: type) -> type:
    name = cls.__name__
    if not issubclass(cls, TokenController):
        raise TypeError(
            f"@controller class {name!r} must subclass aici_controller.TokenController "
            "and define step(self, ctx, new_tokens)"
        )
    if cls.step is TokenController.step:
        raise TypeError(f"@controller class {name!r} does not define step(self, ctx, new_tokens)")
    try:
        inspect.signature(cls).bind()
    except (TypeError, ValueError):
        raise TypeError(
            f"@controller class {name!r} must be constructible without arguments: "
            "read the controller arg in start(self, ctx)"
        ) from None
    return cls


def find_controller(module: ModuleType) -> ControllerSpec:
    """The one controller `module` defines (imported ones do not count)."""
    found = {
        id(value): value
        for value in vars(module).values()
        if isinstance(value, ControllerSpec) and value.module == module.__name__
    }
    specs = list(found.values())  # an alias of the same controller counts once
    where = getattr(module, "__file__", None) or module.__name__
    if not specs:
        raise ValueError(f"{where} does not define a controller: {_USAGE}")
    if len(specs) > 1:
        names = ", ".join(sorted({s.name for s in specs}))
        raise ValueError(
            f"{where} defines {len(specs)} controllers ({names}): a module defines exactly one"
        )
    return specs[0]
