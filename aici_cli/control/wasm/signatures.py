"""The contract's versions, interfaces and function signatures, checked at load.

A component runs under the `aici:controller` version it exports (`find_contract`): 0.2.0
(fork, `step-input.branch`, `host.set-line-output`, and the separately versioned
`aici:storage/storage@0.1.0`) or 0.1.0, which keeps loading and running unchanged. Any
version may import `aici:tools/tools@0.1.0`, versioned apart too; every import is
optional: the host provides what a component imports.

A component built against an edited WIT with the same version fails here, in one line,
instead of failing value conversions mid-run. Also tells how wasmtime-py represents the
values of the variant-like types the host must build (tagged `Variant` or bare payload).
"""

from __future__ import annotations

from dataclasses import dataclass
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

CONSTRUCTOR = "[constructor]runner"
MID_PROCESS = "[method]runner.mid-process"
STORAGE_INTERFACE = "aici:storage/storage@0.1.0"  # versioned apart from aici:controller
TOOLS_INTERFACE = "aici:tools/tools@0.1.0"  # and so is this one

# The contract's function signatures as `signature` renders them (own/borrow handles
# carry no resource name in wasmtime-py's reflection).
_TOKEN_SET = (
    "variant{all, allow(list<u32>), deny(list<u32>), bitmask(list<u32>), host-set(u32), "
    "not-host-set(u32)}"
)
_GRAMMAR = "variant{json-schema(string), regex(string), lark(string), choice(list<string>)}"
_SEGMENT = f"record{{grammar: option<{_GRAMMAR}>, max-tokens: u32, stop: list<string>}}"
_SPLICE = "record{backtrack: u32, ff-tokens: list<u32>}"
_ACTION_0_1 = f"variant{{sample({_TOKEN_SET}), generate({_SEGMENT}), splice({_SPLICE}), stop}}"
_ACTION_0_2 = (
    f"variant{{sample({_TOKEN_SET}), generate({_SEGMENT}), splice({_SPLICE}), stop, fork(u32)}}"
)
_STEP_INPUT_0_1 = "record{backtrack: u32, tokens: list<u32>, segment-text: option<string>}"
_STEP_INPUT_0_2 = (
    "record{backtrack: u32, tokens: list<u32>, segment-text: option<string>, "
    "branch: option<u32>}"
)
_TOKENIZER = {
    "vocab-size": "func() -> u32",
    "eos-token": "func() -> u32",
    "tokenize": "func(text: string) -> list<u32>",
    "decode": "func(tokens: list<u32>) -> string",
    "token-bytes": "func(token: u32) -> list<u8>",
    "tokens-matching": "func(pattern: string) -> result<u32, string>",
}
_HOST = {
    "log": "func(message: string)",
    "set-output": "func(key: string, value: string)",
}
_STORAGE = {
    "get": "func(key: string) -> option<list<u8>>",
    "set": "func(key: string, value: list<u8>)",
    "append": "func(key: string, value: list<u8>) -> u32",
}
_TOOLS = {
    "list-tools": "func() -> list<record{name: string, description: string, "
                  "input-schema: string}>",
    "call-tool": "func(name: string, arguments: string) -> result<string, string>",
}


@dataclass(frozen=True)
class Contract:
    """One version of `aici:controller`: what a component exports and may import.

    A component is run under the version it exports; every version the host knows stays
    loadable (a 0.1.0 component runs unchanged: no fork, no storage). `aici:tools` is
    offered to every version: it is versioned apart, and imported only by those that call
    tools.
    """

    version: str

    def interface(self, name: str) -> str:
        return f"aici:controller/{name}@{self.version}"

    @property
    def controller(self) -> str:
        return self.interface("controller")

    @property
    def tokenizer(self) -> str:
        return self.interface("tokenizer")

    @property
    def host(self) -> str:
        return self.interface("host")

    @property
    def forks(self) -> bool:
        """Whether its guests may fork and use storage (0.2.0 on)."""
        return self.version != "0.1.0"

    @property
    def signatures(self) -> dict[str, dict[str, str]]:
        """Interface -> function -> signature, of every interface this version provides
        (the `types` interface carries only types) and of its export."""
        step, action = (
            (_STEP_INPUT_0_2, _ACTION_0_2) if self.forks else (_STEP_INPUT_0_1, _ACTION_0_1)
        )
        out: dict[str, dict[str, str]] = {
            self.interface("types"): {},
            self.tokenizer: dict(_TOKENIZER),
            self.host: dict(_HOST),
        }
        if self.forks:
            out[self.host]["set-line-output"] = "func(key: string, value: string)"
            out[STORAGE_INTERFACE] = dict(_STORAGE)
        out[TOOLS_INTERFACE] = dict(_TOOLS)
        out[self.controller] = {
            CONSTRUCTOR: "func(arg: string, prompt: list<u32>) -> own",
            MID_PROCESS: f"func(self: borrow, input: {step}) -> result<{action}, string>",
        }
        return out

    @property
    def provided(self) -> list[str]:
        """The interfaces a component of this version may import."""
        return [name for name in self.signatures if name != self.controller]


CONTRACTS = (Contract("0.2.0"), Contract("0.1.0"))  # the newest first
CURRENT = CONTRACTS[0]  # what `wit/controller.wit` defines and `aici-batch build` builds
CONTROLLER_INTERFACE = CURRENT.controller


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


def _instance_funcs(item: Any, wasm_engine: wasmtime.Engine) -> dict[str, FuncType] | None:
    ty = item.ty
    if not isinstance(ty, ComponentInstanceType):
        return None
    return {n: e.ty for n, e in ty.exports(wasm_engine).items() if isinstance(e.ty, FuncType)}


def find_contract(path: Path, component: Component, wasm_engine: wasmtime.Engine) -> Contract:
    """The contract version whose controller interface the component exports (by name:
    `check_exports` checks its functions)."""
    exports = component.type.exports(wasm_engine)
    for contract in CONTRACTS:
        if contract.controller in exports:
            return contract
    names = sorted(exports)
    base = CONTROLLER_INTERFACE.split("@")[0]
    others = [n for n in names if n.split("@", 1)[0] == base]
    known = " or ".join(c.controller for c in CONTRACTS)
    what = (
        f"it exports {', '.join(others)}: built against a version of the contract this host "
        "does not know"
        if others
        else f"it exports {', '.join(names) if names else 'nothing'}"
    )
    raise ComponentError(
        f"{path} does not export {known} ({what}); build controllers "
        "against wit/controller.wit, world controller-world"
    )


def check_imports(path: Path, component: Component, wasm_engine: wasmtime.Engine,
                  contract: Contract) -> None:
    """Every import must be one this host provides to the component's contract version:
    no WASI, no interfaces of another version."""
    imports = component.type.imports(wasm_engine)
    wasi = sorted(name for name in imports if name.startswith("wasi:"))
    if wasi:
        more = f" (and {len(wasi) - 1} more WASI interfaces)" if len(wasi) > 1 else ""
        raise ComponentError(
            f"{path} imports {wasi[0]}{more}, but controllers get no filesystem, "
            "environment, clock or network; build it with `aici-batch build`, which uses "
            "componentize-py --stub-wasi"
        )
    signatures = contract.signatures
    provided = contract.provided
    for name, item in imports.items():
        if name not in provided:
            base = name.split("@", 1)[0]
            same = [p for p in provided if p.split("@", 1)[0] == base]
            hint = (
                f"; this host provides {same[0]} to a {contract.controller} component "
                "(rebuild against wit/controller.wit)"
                if same
                else "; this host provides only " + ", ".join(sorted(provided))
            )
            raise ComponentError(f"{path} imports {name}, which this host does not provide{hint}")
        funcs = _instance_funcs(item, wasm_engine)
        if funcs is None:
            raise ComponentError(f"{path} imports {name} as something other than an instance")
        for func, fty in sorted(funcs.items()):
            if func not in signatures[name]:
                raise ComponentError(
                    f"{path} imports {name}#{func}, which this host does not provide "
                    "(rebuild against wit/controller.wit)"
                )
            _check_signature(path, f"import {name}#{func}", signature(fty), signatures[name][func])


def check_exports(path: Path, component: Component, wasm_engine: wasmtime.Engine,
                  contract: Contract) -> FuncType:
    """The contract interface, its constructor and mid-process; returns mid-process's type."""
    iface = contract.controller
    item = component.type.exports(wasm_engine).get(iface)
    funcs = None if item is None else _instance_funcs(item, wasm_engine)
    if funcs is None:
        raise ComponentError(f"{path} exports {iface} as something other than an instance")
    for name, expected in contract.signatures[iface].items():
        fty = funcs.get(name)
        if fty is None:
            raise ComponentError(
                f"{path} exports {iface} without {name} (it has: "
                f"{', '.join(sorted(funcs)) or 'no functions'})"
            )
        _check_signature(path, f"export {iface}#{name}", signature(fty), expected)
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


def step_field_tagged(mid_process: FuncType, field: str) -> bool:
    """How an `option` field of `step-input` (`segment-text`, `branch`) must be lowered."""
    record = mid_process.params[1][1]
    assert isinstance(record, RecordType)  # check_exports verified the signature
    return is_tagged(dict(record.fields)[field])


def imports(component: Component, wasm_engine: wasmtime.Engine, iface: str) -> bool:
    """Whether the component imports interface `iface` (the host links only those)."""
    return iface in component.type.imports(wasm_engine)


def import_result_tagged(component: Component, wasm_engine: wasmtime.Engine, iface: str,
                         func: str) -> bool:
    """How an import's variant-like result (`tokens-matching`'s `result<u32, string>`,
    storage `get`'s `option<list<u8>>`, `call-tool`'s `result<string, string>`) must be
    lowered (False when the component does not import it)."""
    item = component.type.imports(wasm_engine).get(iface)
    if item is None or not isinstance(item.ty, ComponentInstanceType):
        return False
    f = item.ty.exports(wasm_engine).get(func)
    if f is None or not isinstance(f.ty, FuncType) or f.ty.result is None:
        return False
    return is_tagged(f.ty.result)
