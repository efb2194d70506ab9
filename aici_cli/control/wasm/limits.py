"""Per-guest resource limits, and why each one is there.

- Per call: fuel (`fuel_per_call`, a deterministic CPU bound) and an epoch deadline
  (`call_ms`; `init_ms` for instantiation and the constructor) in the calling thread's
  CPU time, so that a loaded machine or a wait for the GIL does not fail a guest. Time
  spent inside host functions (for example a first `tokens-matching` over a 262k
  vocabulary) is not charged to the guest's deadline.
- Per store: a memory cap (`memory_bytes`). wasmtime makes `memory.grow` fail (return
  -1) at the cap rather than trap, and the guest then usually aborts; the host reports
  `controller_memory` when it can tell (an allocator-failure frame such as
  `handle_alloc_error` in the backtrace, or a cap too small to instantiate), and
  `controller_trap` otherwise. A componentize-py guest turns MemoryError into an
  uncaught exception, whose traceback needs the stubbed-out WASI: that one reads as a
  trap.
- Per store: a table cap (`table_elements`). Tables live in host memory outside the
  linear-memory cap, and `table.grow` can otherwise claim ~2 GB a second.
- What a guest leaves in its result line is capped, so a chatty or hostile guest cannot
  grow the process or a result line without bound: logs (`log_bytes`, cut with a note:
  they are for people, and the head is what explains a failure), outputs (`max_outputs`
  keys and `output_bytes` of key and value text, a precise error instead: outputs are
  data a program reads, and silently cut data would be worse than none), and the text of
  a guest `err` (`error_chars`, cut with a note). Each `tokens-matching` pattern costs a
  vocabulary scan and a cached bitmask, so a sequence may ask for `max_patterns` distinct
  ones of at most `pattern_chars` characters; past that the guest gets `err`.
- What a line's branches share (`aici:storage`, contract 0.2.0) is capped per line:
  `storage_keys` keys and `storage_bytes` of key and value bytes; a write past either
  ends the line with `storage_quota` (the data is the controller's own state: a write
  that silently did not happen would be worse than an error). The line's own outputs
  (`set-line-output`) have the per-sequence output caps.
- A tool call (`aici:tools`) holds the engine's step until its answer is in, up to
  `--tool-timeout`, so a sequence may make `max_tool_calls`; past that its calls are
  answered `err` (`tool_quota`) without reaching a tool, and the guest goes on.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GuestLimits:
    """Per-guest resource limits: wasmtime enforces the first five, the host the rest."""

    call_ms: int = 50  # CPU-time deadline per mid-process call (epoch interruption)
    init_ms: int = 2000  # deadline for instantiation and the constructor (Python is slow)
    fuel_per_call: int = 2_000_000_000  # CPU bound per call (Config.consume_fuel)
    memory_bytes: int = 256 << 20  # cap per linear memory (a Python guest needs ~12.3 MiB)
    table_elements: int = 1 << 20  # cap per table (a Python guest starts with ~5,700)
    log_bytes: int = 64 << 10  # per-sequence log text (+1 per line); beyond it: cut, a note
    max_outputs: int = 256  # per-sequence distinct output keys; beyond: too_many_outputs
    output_bytes: int = 1 << 20  # per-sequence key + value text; beyond: outputs_too_large
    error_chars: int = 4096  # a guest err's text is cut to this, with a note
    max_patterns: int = 32  # distinct tokens-matching patterns per sequence; beyond: err
    pattern_chars: int = 16 << 10  # longest tokens-matching pattern; longer: err
    storage_keys: int = 256  # per-line storage keys; beyond: storage_quota
    storage_bytes: int = 1 << 20  # per-line storage key + value bytes; beyond: storage_quota
    max_tool_calls: int = 32  # aici:tools calls per sequence; beyond: err (tool_quota)


DEFAULT_GUEST_LIMITS = GuestLimits()
