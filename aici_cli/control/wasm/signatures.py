"""The contract's interfaces and function signatures, checked against a component at load.

A component built against an edited WIT with the same version fails here, in one line,
instead of failing value conversions mid-run. Also tells how wasmtime-py represents the
values of the variant-like types the host must build (tagged `Variant` or bare payload).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import wasmtime
from wasmtime.component import (
    BorrowType,
    Component,
    ComponentInstanceType,
    EnumType,
    FlagsType,
    FuncType,
    ListType,
    OptionType,
    OwnType,
    RecordType,
    ResultType,
    TupleType,
    Variant,
    VariantType,
)

from aici_cli.control.wasm.component_file import ComponentError

CONTROLLER_INTERFACE = "aici:controller/controller@0.1.0"
TYPES_INTERFACE = "aici:controller/types@0.1.0"
TOKENIZER_INTERFACE = "aici:controller/tokenizer@0.1.0"
HOST_INTERFACE = "aici:controller/host@0.1.0"
CONSTRUCTOR = "[constructor]runner"
MID_PROCESS = "[method]runner.mid-process"

# The interfaces this host provides to guests (types carries only types).
PROVIDED = (TYPES_INTERFACE, TOKENIZER_INTERFACE, HOST_INTERFACE)

# The contract's function signatures as `signature` renders them (own/borrow handles
# carry no resource name in wasmtime-py's reflection).
_TOKEN_SET = (
    "variant{all, allow(list<u32>), deny(list<u32>), bitmask(list<u32>), host-set(u32), "
    "not-host-set(u32)}"
)
_GRAMMAR = "variant{json-schema(string), regex(string), lark(string), choice(list<string>)}"
_SEGMENT = f"record{{grammar: option<{_GRAMMAR}>, max-tokens: u32, stop: list<string>}}"
_ACTION = (
    f"variant{{sample({_TOKEN_SET}), generate({_SEGMENT}), "
    "splice(record{backtrack: u32, ff-tokens: list<u32>}), stop}"
)
_STEP_INPUT = "record{backtrack: u32, tokens: list<u32>, segment-text: option<string>}"
SIGNATURES: dict[str, dict[str, str]] = {
    TYPES_INTERFACE: {},
    TOKENIZER_INTERFACE: {
        "vocab-size": "func() -> u32",
        "eos-token": "func() -> u32",
        "tokenize": "func(text: string) -> list<u32>",
        "decode": "func(tokens: list<u32>) -> string",
        "token-bytes": "func(token: u32) -> list<u8>",
        "tokens-matching": "func(pattern: string) -> result<u32, string>",
    },
    HOST_INTERFACE: {
        "log": "func(message: string)",
        "set-output": "func(key: string, value: string)",
    },
    CONTROLLER_INTERFACE: {
        CONSTRUCTOR: "func(arg: string, prompt: list<u32>) -> own",
        MID_PROCESS: f"func(self: borrow, input: {_STEP_INPUT}) -> result<{_ACTION}, string>",
    },
}


def signature(ty: Any) -> str:
    """WIT-like text of a reflected wasmtime type (structural: type names are not kept)."""
    if isinstance(ty, FuncType):
        params = ", ".join(f"{name}: {signature(t)}" for name, t in ty.params)
        result = ty.result
        return f"func({params})" + ("" if result is None else f" -> {signature(result)}")
    if isinstance(ty, ListType):
        return f"list<{signature(ty.element)}>"
    if isinstance(ty, OptionType):
        return f"option<{signature(ty.payload)}>"
    if isinstance(ty, ResultType):
        ok, err = ty.ok, ty.err
        return f"result<{'_' if ok is None else signature(ok)}, " + (
            "_>" if err is None else f"{signature(err)}>"
        )
    if isinstance(ty, RecordType):
        fields = ", ".join(f"{name}: {signature(t)}" for name, t in ty.fields)
        return f"record{{{fields}}}"
    if isinstance(ty, VariantType):
        cases = ", ".join(n if t is None else f"{n}({signature(t)})" for n, t in ty.cases)
        return f"variant{{{cases}}}"
    if isinstance(ty, TupleType):
        return f"tuple<{', '.join(signature(t) for t in ty.elements)}>"
    if isinstance(ty, EnumType):
        return f"enum{{{', '.join(ty.names)}}}"
    if isinstance(ty, FlagsType):
        return f"flags{{{', '.join(ty.names)}}}"
    if isinstance(ty, OwnType):
        return "own"
    if isinstance(ty, BorrowType):
        return "borrow"
    return type(ty).__name__.lower()  # the primitives: u32, string, bool, ...


def _check_signature(path: Path, where: str, found: str, expected: str) -> None:
    if found == expected:
        return
    i = next((k for k, (a, b) in enumerate(zip(found, expected)) if a != b), None)
    if i is None:
        i = min(len(found), len(expected))
    if max(len(found), len(expected)) <= 120:
        detail = f"`{found}`, but this host expects `{expected}`"
    else:
        lo = max(0, i - 30)
        detail = (
            f"a signature that differs from this host's at `...{found[lo : i + 30]}...` "
            f"(expected `...{expected[lo : i + 30]}...`)"
        )
    raise ComponentError(f"{path}: {where} has {detail}; rebuild against wit/controller.wit")


def _instance_funcs(item: Any, engine: wasmtime.Engine) -> dict[str, FuncType] | None:
    ty = item.ty
    if not isinstance(ty, ComponentInstanceType):
        return None
    return {n: e.ty for n, e in ty.exports(engine).items() if isinstance(e.ty, FuncType)}


def check_imports(path: Path, component: Component, engine: wasmtime.Engine) -> None:
    """Every import must be one this host provides: no WASI, no other contract version."""
    imports = component.type.imports(engine)
    wasi = sorted(name for name in imports if name.startswith("wasi:"))
    if wasi:
        more = f" (and {len(wasi) - 1} more WASI interfaces)" if len(wasi) > 1 else ""
        raise ComponentError(
            f"{path} imports {wasi[0]}{more}, but controllers get no filesystem, "
            "environment, clock or network; build it with `aici-batch build`, which uses "
            "componentize-py --stub-wasi"
        )
    for name, item in imports.items():
        provided = SIGNATURES[name] if name in PROVIDED else None
        if provided is None:
            base = name.split("@", 1)[0]
            same = [p for p in PROVIDED if p.split("@", 1)[0] == base]
            hint = (
                f"; this host provides {same[0]} (rebuild against wit/controller.wit)"
                if same
                else "; this host provides only " + ", ".join(sorted(PROVIDED))
            )
            raise ComponentError(f"{path} imports {name}, which this host does not provide{hint}")
        funcs = _instance_funcs(item, engine)
        if funcs is None:
            raise ComponentError(f"{path} imports {name} as something other than an instance")
        for func, fty in sorted(funcs.items()):
            if func not in provided:
                raise ComponentError(
                    f"{path} imports {name}#{func}, which this host does not provide "
                    "(rebuild against wit/controller.wit)"
                )
            _check_signature(path, f"import {name}#{func}", signature(fty), provided[func])


def check_exports(path: Path, component: Component, engine: wasmtime.Engine) -> FuncType:
    """The contract interface, its constructor and mid-process; returns mid-process's type."""
    exports = component.type.exports(engine)
    item = exports.get(CONTROLLER_INTERFACE)
    funcs = None if item is None else _instance_funcs(item, engine)
    if funcs is None:
        names = sorted(exports)
        others = [n for n in names if n.split("@", 1)[0] == CONTROLLER_INTERFACE.split("@")[0]]
        what = (
            f"it exports {', '.join(others)}: built against another version of the contract"
            if others
            else f"it exports {', '.join(names) if names else 'nothing'}"
        )
        raise ComponentError(
            f"{path} does not export {CONTROLLER_INTERFACE} ({what}); build controllers "
            "against wit/controller.wit, world controller-world"
        )
    for name, expected in SIGNATURES[CONTROLLER_INTERFACE].items():
        fty = funcs.get(name)
        if fty is None:
            raise ComponentError(
                f"{path} exports {CONTROLLER_INTERFACE} without {name} (it has: "
                f"{', '.join(sorted(funcs)) or 'no functions'})"
            )
        _check_signature(path, f"export {CONTROLLER_INTERFACE}#{name}", signature(fty), expected)
    return funcs[MID_PROCESS]


def is_tagged(ty: Any) -> bool:
    """Whether wasmtime-py represents values of this variant-like type as `Variant`.

    wasmtime-py uses `Variant(tag, payload)` only when two cases' Python classes overlap;
    otherwise a value is its bare payload (None for a payload-less case). `add_classes`
    is the public hook that tells which classes a type accepts.
    """
    classes: set[type] = set()
    ty.add_classes(classes)
    return Variant in classes


def segment_text_tagged(mid_process: FuncType) -> bool:
    """How `step-input.segment-text` (an `option<string>`) must be lowered."""
    record = mid_process.params[1][1]
    assert isinstance(record, RecordType)  # check_exports verified the signature
    return is_tagged(dict(record.fields)["segment-text"])


def tokens_matching_tagged(component: Component, engine: wasmtime.Engine) -> bool:
    """How the `tokens-matching` import's `result<u32, string>` must be lowered (False
    when the component does not import it)."""
    tm = component.type.imports(engine).get(TOKENIZER_INTERFACE)
    if tm is None or not isinstance(tm.ty, ComponentInstanceType):
        return False
    f = tm.ty.exports(engine).get("tokens-matching")
    if f is None or not isinstance(f.ty, FuncType) or f.ty.result is None:
        return False
    return is_tagged(f.ty.result)
