"""The one place a controller decides: every directive a controller answers (at `start`,
after a token, at end-of-sequence, entering a branch) is applied through
`Decisions.consult`, which also times the controller and confines any exception to its
generation; and the forks such a directive asks for.

A fork asked for during a step is not made there: the generation takes no more tokens
(`Generation.forking`), and `make_fork` runs between steps, before the next plan, so
nothing starts mid-step. A fork asked for between steps (a controller's `start`, a
branch's `enter_branch`) is made at once, depth first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

from aici_cli.control.base import Directive
from aici_cli.engine.clock import Now, ms
from aici_cli.engine.generation import Generation
from aici_cli.engine.logits.masks import controller_fault
from aici_cli.engine.logits.sampler import branch_stream

Place = Callable[[Generation], None]  # a generation that is done, or waits for a row


class Decisions:
    def __init__(self, tokenizer: Any, eos: Collection[int], max_branches: int,
                 now: Now) -> None:
        self.tokenizer = tokenizer
        self.eos = eos
        self.max_branches = max_branches
        self.now = now

    def consult(self, gen: Generation,
                ask: Callable[[], Directive | None]) -> tuple[bool, float]:
        """Run `ask`, apply its directive (None: the generation stops), and time it. A
        failure ends only this generation. Returns whether the output changed (or a fork
        is wanted), and the controller's ms."""
        t0 = self.now()
        changed = False
        try:
            directive = ask()
            if directive is None:
                gen.finish_with("stop")
            else:
                changed = gen.apply(directive)
                changed = _want_fork(gen, directive) or changed
        except Exception as e:
            gen.finish_with("error", controller_fault(e))
        spent = ms(t0, self.now())
        gen.stats.controller_ms += spent
        return changed, spent

    def apply_deferred(self, gen: Generation, directive: Directive) -> None:
        """A directive the controller answered in place of a mask (decided, and timed, in
        the mask worker): applied as `consult` would."""
        try:
            gen.apply(directive)
            _want_fork(gen, directive)
        except Exception as e:
            gen.finish_with("error", controller_fault(e))
        self.check_stop(gen)

    def check_stop(self, gen: Generation) -> bool:
        """Finish `gen` on its line's stop terms (stops.py: a stop token id, which is cut
        off with what follows it, a stop string, max_tokens); True when it is finished
        (already, or now)."""
        if gen.finish is not None:
            return True
        stop = gen.stops.check(gen.job, gen.output, self.tokenizer)
        if stop is None:
            return False
        if stop.keep is not None:
            gen.backtrack(len(gen.output) - stop.keep)
        gen.finish_with(stop.reason, text_end=stop.text_end)
        return True

    def ends(self, gen: Generation, token: int) -> bool:
        """Whether sampling `token` ends the generation rather than appending it: EOS, but
        with ignore_eos only where a controller takes it (a constraint's end)."""
        return token in self.eos and not (gen.job.ignore_eos and gen.controller is None)

    def take_token(self, gen: Generation, token: int) -> float:
        """`token` follows the generation's tokens (all in the cache): end at EOS (unless
        the controller takes it as a segment's end), or append it and ask the controller
        what follows. Returns the controller's ms."""
        controller = gen.controller
        if self.ends(gen, token):
            if controller is None:
                gen.finish_with("stop")
                return 0.0
            _, spent = self.consult(gen, controller.on_eos)
            self.check_stop(gen)
            return spent
        gen.append(token)
        if self.check_stop(gen) or controller is None:
            return 0.0
        changed, spent = self.consult(gen, lambda: controller.advance([token]))
        if changed:  # only a changed output needs another look for stop strings
            self.check_stop(gen)
        return spent

    # Long: the fork's steps in the order the contract gives them (refuse, make the
    # controllers, then each branch's first decision, depth first); split, each part would
    # need the branches list and the line's state passed around.
    def make_fork(self, gen: Generation, finish: Place, wait: Place) -> None:
        """The fork `gen` wants, after its current tokens: `gen` goes on as branch 0;
        branches 1..n-1 get the other controllers (`Controller.fork`) and `wait` for rows
        (or `finish` at once). Each branch is then asked its first decision, in branch
        order. A fork past `--max-branches`, or one whose controllers cannot be made, ends
        `gen` with that error (and the line with it)."""
        fork, controller = gen.branch, gen.controller
        if fork is None:
            return
        n, line = fork.take_wanted(), fork.line
        if not n or controller is None or line.failed:
            return
        refused = line.would_exceed(n, self.max_branches)
        if refused is not None:
            gen.finish_with("error", ("bad_action", refused))
            return
        t0 = self.now()
        try:
            others = controller.fork(n)
        except Exception as e:
            gen.finish_with("error", controller_fault(e))
            return
        replay_ms = ms(t0, self.now()) / len(others)
        line.forked_into(n)
        base = fork.go_on()
        branches = [gen]
        for k, other in enumerate(others, 1):
            path = base + (k,)
            stream = branch_stream(gen.job.sampling.seed, gen.sample, path)
            branch = gen.split(other, stream, path)
            branch.stats.controller_ms += replay_ms
            branches.append(branch)
        for k, branch in enumerate(branches):
            assert branch.controller is not None
            self.consult(branch, functools.partial(branch.controller.enter_branch, k))
            self.make_fork(branch, finish, wait)  # a branch may fork again at once
            faulted = branch.finish is not None and branch.finish.reason == "error"
            self.check_stop(branch)
            if branch is not gen:  # `gen` goes on with its caller
                if branch.finish is not None:
                    finish(branch)
                else:
                    wait(branch)
            if faulted or line.failed:  # the line ends: the later branches never start
                for left in branches[k + 1 :]:
                    assert left.controller is not None
                    left.controller.close()
                return


def _want_fork(gen: Generation, directive: Directive) -> bool:
    """A directive's fork, asked for by a generation that goes on: made between steps
    (`make_fork`). Returns whether one is wanted."""
    if not directive.fork or gen.finish is not None or gen.branch is None:
        return False
    gen.branch.want(directive.fork)
    return True
