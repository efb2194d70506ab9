"""The guest SDK for aici-batch controllers (built into WebAssembly components).

A controller steers one sequence. Write a generator function of segments:

    from aici_controller import controller, fixed, gen, set_output

    @controller
    def yes_no(ctx):
        yield fixed(" Answer: ")
        answer = yield gen(choices=["yes", "no"])   # the host enforces the segment
        set_output("answer", answer)

or subclass `TokenController` to decide every token. `branch = yield fork(3)` splits the
sequence into branches that share its tokens; `storage` is shared by a line's branches,
`set_line_output` reports across them; `tools` calls the tools the run allows
(`--allow-tool`). Build with `aici-batch build FILE`; test in plain CPython with
`aici_controller.testing.StubHost`.

In a built component there is no filesystem and no WASI: import everything at module
top level (the build snapshots imported modules), and `print` goes to the sequence's logs.
"""

from __future__ import annotations

from . import storage, tools
from ._actions import (
    ALL,
    Action,
    Allow,
    AllTokens,
    Bitmask,
    Deny,
    Fork,
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
    fork,
    gen,
    gen_json,
    not_matching,
    sample,
    splice_tokens,
    stop,
    tokens_matching,
)
from ._controller import Context, ControllerSpec, TokenController, controller, find_controller
from ._host import Host, log, set_line_output, set_output
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
    "Fork",
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
    "fork",
    "gen",
    "gen_json",
    "log",
    "not_matching",
    "sample",
    "set_line_output",
    "set_output",
    "splice_tokens",
    "stop",
    "storage",
    "tokens_matching",
    "tools",
]
