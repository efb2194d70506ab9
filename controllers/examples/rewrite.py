"""Splicing: generate a word, and if it is not capitalized take it back and rewrite it.

`backtrack(n, text)` removes the segment's n tokens and forces the corrected text in one
host step, so the rest of the sequence continues from the rewritten word.
Outputs: "word" (as generated), "final" (as kept), "rewrote" (bool).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, backtrack, controller, fixed, gen, set_output


@controller
def rewrite(ctx: Context) -> Generator[Any, Any, None]:
    yield fixed("Name: ")
    word = yield gen(regex=r"[A-Za-z]{1,12}", max_tokens=8)
    set_output("word", word)
    final = word[:1].upper() + word[1:]
    rewrote = final != word
    if rewrote:
        # ctx.last_tokens: the tokens the segment appended (all of the word).
        yield backtrack(len(ctx.last_tokens), final)
    set_output("final", final)
    set_output("rewrote", rewrote)
    yield fixed(".\n")
