"""Built-in controllers: JSON schema, regex and choice, enforced by llguidance.

Costs: wrapping a tokenizer for llguidance takes about 0.3 s at a 49k vocabulary and 4 s
at 262k, so `GrammarCompiler` builds it once per model. Compiling a grammar takes 0.1-100
ms; each distinct grammar is compiled once per run into a template matcher, and each
sequence gets a `deep_copy` of it. A mask costs about 50-90 us per row; the engine fills
all rows' masks in parallel (`LLExecutor`) while the forward pass runs.

Bounds: every grammar is compiled and run under `GRAMMAR_LIMITS`, and JSON schemas are
first held to `MAX_SCHEMA_DEPTH`, `MAX_SCHEMA_NODES` and `MAX_OBJECT_PROPERTIES`, so no
constraint makes compiling take more than about 4 s (real ones: milliseconds), nor a mask
more than about 40 ms step after step (a 0.2 s mask happens once, as the step that ends
its sequence). A constraint past a limit is that line's error (`grammar_too_large` when
compiling, `grammar_too_complex` at a step), never a hang.

A JSON schema with keywords the grammar cannot express (`uniqueItems`, `not`, ...) gets a
`KeywordGuard` (keyword_guard.py): a scan of each token's bytes, a check at each value's
end where such a keyword applies, and a retry (a backtrack, a token barred) where one
breaks; nothing for other schemas. A schema whose objects may hold keys they do not
declare gets `DistinctKeys` (distinct_keys.py): no key is written twice in an object.
"""

from aici_cli.control.grammar.compiler import CompiledGrammar, GrammarCompiler
from aici_cli.control.grammar.controller import GrammarController

__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarController"]
