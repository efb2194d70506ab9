"""The guest half of the step protocol, shared by the component and the stub host.

One `Session` per sequence (per WIT `runner`). The host calls `step` once at the start
with no tokens, then after each action it applied:
- after `sample`: the sampled token (the generator receives its id);
- after `generate`: the segment's tokens and `segment_text` (the generator receives the
  text; without `segment_text` it decodes the tokens);
- after `splice`: `backtrack` = the splice's count, `tokens` = its tokens (the generator
  receives None);
- after `fork(n)`: once in each branch, with no tokens and `branch` = its index (the
  generator receives the index; a `TokenController` gets `on_fork`).
`step` resolves symbolic actions with host calls (`fixed` text -> token ids, a
`tokens_matching` pattern -> a host handle, cached per pattern), so what it returns maps
one-to-one onto the WIT `action`. Any exception from controller code becomes
`ControllerFailed` (the component turns it into `Err`), after which the session only
reports that failure again: one failing controller ends only its own sequence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import traceback
from collections.abc import Generator, Sequence
from typing import Any

from . import _host
from ._actions import ACTION_TYPES, Action, Fork, Generate, Matching, Sample, Splice, Stop
from ._controller import Context, ControllerSpec, TokenController
from ._host import Host

# No os.path.abspath anywhere here: it calls getcwd, which traps in a component.
_SDK_DIR = os.path.dirname(__file__)
_MAX_FRAMES = 6


class ControllerFailed(Exception):
    """Controller code raised; `message` ("ValueError: ...") is the sequence's error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Session:
    """Drives one controller for one sequence. Not thread-safe (one per sequence)."""

    def __init__(self, spec: ControllerSpec, host: Host, arg: str, prompt: Sequence[int]) -> None:
        # Nothing here runs controller code: a constructor cannot return an error over
        # the WIT, so `start` and the generator's first lines run in the first step.
        self.spec = spec
        self.host = host
        self.ctx = Context(host, arg, prompt)
        self._started = False
        self._finished = False
        self._failure: str | None = None
        self._last: Action | None = None
        self._gen: Generator[Any, Any, Any] | None = None
        self._instance: TokenController | None = None
        self._handles: dict[str, int] = {}

    @property
    def finished(self) -> bool:
        return self._finished

    def step(
        self,
        backtrack: int,
        tokens: Sequence[int],
        segment_text: str | None = None,
        branch: int | None = None,
    ) -> Action:
        """Apply what the host reports, run the controller, return its resolved action.

        Raises `ControllerFailed`; after `Stop` it keeps answering `Stop`.
        """
        if self._failure is not None:
            raise ControllerFailed(f"the controller already failed: {self._failure}")
        if self._finished:
            return Stop()
        with _host.active(self.host):
            try:
                action = self._resolve(self._advance(backtrack, tokens, segment_text, branch))
            except Exception as exc:
                self._fail(exc)
                raise ControllerFailed(self._failure or "") from exc
        self._last = action
        if isinstance(action, Stop):
            self._finish()
        return action

    def _advance(self, backtrack: int, tokens: Sequence[int], segment_text: str | None,
                 branch: int | None) -> Action:
        first = not self._started
        self._started = True
        forked = isinstance(self._last, Fork)
        if forked != (branch is not None):
            raise RuntimeError(
                "the host answered fork(...) without a branch index" if forked
                else f"the host sent branch index {branch} without a fork"
            )
        self.ctx._apply(backtrack, tokens, segment_text, branch)
        name = self.spec.name
        if self.spec.kind == "token":
            if first:
                self._instance = self.spec.target()
                self._instance.start(self.ctx)
            assert self._instance is not None
            if branch is not None:
                action = self._instance.on_fork(self.ctx, branch)
                return _check_action(action, f"{name}.on_fork() returned")
            action = self._instance.step(self.ctx, self.ctx.last_tokens)
            return _check_action(action, f"{name}.step() returned")
        if first:
            gen = self.spec.target(self.ctx)
            if not inspect.isgenerator(gen):
                raise TypeError(f"controller {name!r} did not return a generator")
            self._gen = gen
            value = None
        else:
            value = self._resume_value()
        assert self._gen is not None
        try:
            action = self._gen.send(value)
        except StopIteration:
            return Stop()
        return _check_action(action, f"controller {name!r} yielded")

    def _resume_value(self) -> Any:
        """What the generator's pending `yield` evaluates to, given the last action."""
        last = self._last
        if isinstance(last, Sample):
            if not self.ctx.last_tokens:
                raise RuntimeError("the host answered sample(...) without a token")
            return self.ctx.last_tokens[-1]
        if isinstance(last, Generate):
            if self.ctx.segment_text is not None:
                return self.ctx.segment_text
            return self.host.decode(list(self.ctx.last_tokens))
        if isinstance(last, Fork):
            return self.ctx.branch
        return None

    def _resolve(self, action: Action) -> Action:
        if isinstance(action, Splice):
            if action.backtrack > len(self.ctx.tokens):
                raise ValueError(
                    f"backtrack({action.backtrack}) removes more than the "
                    f"{len(self.ctx.tokens)} tokens generated so far"
                )
            if action.tokens is None:
                ids = tuple(self.host.tokenize(action.text)) if action.text else ()
                return dataclasses.replace(action, tokens=ids)
        elif isinstance(action, Sample) and isinstance(action.tokens, Matching):
            pattern = action.tokens.pattern
            handle = self._handles.get(pattern)
            if handle is None:
                handle = self._handles[pattern] = self.host.tokens_matching(pattern)
            return Sample(dataclasses.replace(action.tokens, handle=handle))
        return action

    def _fail(self, exc: BaseException) -> None:
        self._failure = describe_error(exc)
        self._finish()
        where = user_frames(exc)
        suffix = f" (at {where})" if where else ""
        with contextlib.suppress(Exception):  # the error matters more than its log line
            self.host.log(f"controller error: {self._failure}{suffix}")

    def _finish(self) -> None:
        self._finished = True
        gen, self._gen = self._gen, None
        if gen is not None:
            with contextlib.suppress(Exception):
                gen.close()  # runs the controller's `finally` blocks now


def _check_action(value: Any, what: str) -> Action:
    if isinstance(value, ACTION_TYPES):
        return value
    if inspect.isgenerator(value):
        raise TypeError(
            f"{what} a generator: use `x = yield from gen_json(...)`, not `yield gen_json(...)`"
        )
    raise TypeError(
        f"{what} {type(value).__name__} {value!r:.60}: expected an action "
        "(fixed(...), gen(...), sample(...), backtrack(...), fork(...) or stop())"
    )


def describe_error(exc: BaseException) -> str:
    """ "Type: message", the form a failed sequence reports."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def user_frames(exc: BaseException) -> str:
    """The innermost controller-code frames, "file:line in func"; SDK frames left out.

    Reads no source lines: a component has no filesystem at run time.
    """
    frames = [
        f"{os.path.basename(frame.f_code.co_filename)}:{lineno} in {frame.f_code.co_name}"
        for frame, lineno in traceback.walk_tb(exc.__traceback__)
        if os.path.dirname(frame.f_code.co_filename) != _SDK_DIR
    ]
    return " <- ".join(reversed(frames[-_MAX_FRAMES:]))
