"""Reading a controller component's file, and the error of one that cannot be used."""

from __future__ import annotations

from pathlib import Path

import wasmtime


class ComponentError(Exception):
    """A controller component cannot be used at all (usage level: the CLI exits 2).

    The message is one line that names the file and says how to fix the problem.
    """


def read_wasm(path: Path) -> bytes:
    """The component's binary: a .wasm file, or WebAssembly text (used by the tests)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ComponentError(f"controller component not found: {path}") from None
    except IsADirectoryError:
        raise ComponentError(f"controller component {path} is a directory, not a file") from None
    except OSError as e:
        raise ComponentError(f"cannot read controller component {path}: {e.strerror}") from None
    if not data.startswith(b"\0asm"):
        data = _assemble(path, data)
    layer = data[4:8]
    if layer == b"\x01\0\0\0":
        raise ComponentError(
            f"{path} is not a WebAssembly component: it is a core WebAssembly module; "
            "controllers must be components of world aici:controller/controller-world "
            "(build one with `aici-batch build`)"
        )
    if len(layer) < 4 or layer[2:4] != b"\x01\0":
        raise ComponentError(
            f"{path} is not a WebAssembly component (unknown WebAssembly version/layer "
            f"{layer.hex()})"
        )
    return data


def _assemble(path: Path, data: bytes) -> bytes:
    """The binary of a file that is not one: WebAssembly text, or a ComponentError."""
    text = _as_text(data)
    if text is None:
        raise ComponentError(
            f"{path} is not a WebAssembly component (not a WebAssembly file at all); "
            "build one with `aici-batch build`"
        )
    try:
        return bytes(wasmtime.wat2wasm(text))
    except wasmtime.WasmtimeError as e:
        raise ComponentError(
            f"{path} is not a WebAssembly component: invalid WebAssembly text: "
            f"{_first_line(str(e))}"
        ) from None


def _as_text(data: bytes) -> str | None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    head = text.lstrip()
    return text if head.startswith(("(", ";;")) else None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"
