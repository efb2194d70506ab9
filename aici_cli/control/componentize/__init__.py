"""Build a controller into a WebAssembly component: `python.py` (componentize-py) and
`js.py` (componentize-js), over what both share in `toolchain.py` (the contract, the error
and result types, running a componentizer); `info.py` writes and reads the build-info
section a built component carries.

Imports run one way: `__init__` → `python`, `js` → `toolchain`, `info`. Standard library
only, so the front door may import this package without torch or wasmtime.
"""

from __future__ import annotations

from pathlib import Path

from aici_cli.control.componentize.js import JS_SUFFIXES, build_js_controller
from aici_cli.control.componentize.python import build_python_controller
from aici_cli.control.componentize.toolchain import (
    BuildError,
    BuildResult,
    checked_wit_dir,
    wit_text,
    write_wit,
)

__all__ = ["BuildError", "BuildResult", "build_controller", "wit_text", "write_wit"]


def build_controller(
    src: Path, out: Path, wit_dir: Path | None = None, *, timeout: float = 600
) -> BuildResult:
    """Build the controller in `src` into the component `out` (written only on success).

    A `.js` or `.mjs` source is a JavaScript controller (`js.build_js_controller`), any
    other a Python one (`python.build_python_controller`, which refuses a non-`.py` file).
    Raises `BuildError` for every expected failure.
    """
    src, out = Path(src), Path(out)
    if src.suffix in JS_SUFFIXES:
        return build_js_controller(src, out, checked_wit_dir(wit_dir), timeout=timeout)
    return build_python_controller(src, out, wit_dir, timeout=timeout)
