"""The built-in JSON-schema controller's job as a wasm controller: one host segment.

Arg: the JSON schema (the line's `controller_arg`). Used by bench/controller_costs.py to
compare a segment-based controller with the built-in one on the same constraint.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from aici_controller import Context, controller, gen


@controller
def schema_segment(ctx: Context) -> Generator[Any, Any, None]:
    yield gen(json_schema=ctx.arg, max_tokens=100_000)
