"""The guest SDK for aici-batch controllers (built into WebAssembly components).

A controller steers one sequence. Write a generator function of segments:

    from aici_controller import controller, fixed, gen, set_output

    @controller
    def yes_no(ctx):
        yield fixed(" Answer: ")
        answer = yield gen(choices=["yes", "no"])   # the host enforces the segment
        set_output("answer", answer)

or subclass `TokenController` to decide every token. Build with `aici-batch build FILE`;
test in plain CPython with `aici_controller.testing.StubHost`.

In a built component there is no filesystem and no WASI: import everything at module
top level (the build snapshots imported modules), and `print` goes to the sequence's logs.
"""

from __future__ import annotations

from ._actions import (
    ALL,
    Action,
    Allow,
    AllTokens,
    Bitmask,
    Deny,
    Generate,
    Grammar,
    Matching,
    Sample,
    Splice,
    Stop,
    TokenSet,
    allow,
    backtrack,
    deny,
    fixed,
    gen,
    gen_json,
    not_matching,
    sample,
    splice_tokens,
    stop,
    tokens_matching,
)
from ._controller import Context, ControllerSpec, TokenController, controller, find_controller
from ._host import Host, log, set_output
from ._session import ControllerFailed

__all__ = [
    "ALL",
    "Action",
    "AllTokens",
    "Allow",
    "Bitmask",
    "Context",
    "ControllerFailed",
    "ControllerSpec",
    "Deny",
    "Generate",
    "Grammar",
    "Host",
    "Matching",
    "Sample",
    "Splice",
    "Stop",
    "TokenController",
    "TokenSet",
    "allow",
    "backtrack",
    "controller",
    "deny",
    "find_controller",
    "fixed",
    "gen",
    "gen_json",
    "log",
    "not_matching",
    "sample",
    "set_output",
    "splice_tokens",
    "stop",
    "tokens_matching",
]
