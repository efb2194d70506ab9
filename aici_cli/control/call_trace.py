"""What a controller reports of its guest calls to a tracer (`aici_cli/run/tracing.py`).

A `WasmController` with a `trace` calls it once per call into its guest: `start`
(instantiate and construct), `mid-process`, `fork replay` (a new branch's guest brought
to the fork point) and `grammar compile` (a segment's grammar). Times are the
`time.perf_counter()` seconds around the call. Without a tracer, `trace` is None and the
controller pays one attribute test per call.
"""

from __future__ import annotations

from typing import Any, Protocol


class CallTrace(Protocol):
    def __call__(self, name: str, t0: float, t1: float,
                 attributes: dict[str, Any] | None = None) -> None: ...
