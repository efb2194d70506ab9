"""The functions a guest imports (`tokenizer`, `host`, from contract 0.2.0 on
`aici:storage/storage`, and `aici:tools/tools` where the component imports it), bound once
per component.

One `Linker` per component serves every guest instance of it: a host function finds the
instance whose call is in progress on its thread in `host_calls.current` (a guest call and
the host functions it calls run on the same thread, so this is exact) and serves the call
through that instance's `HostCalls` methods: its services and quotas.

Host functions never let a Python exception reach wasmtime-py: it parks those in a
process-global slot and re-raises them from whichever call looks next, which is a race
between threads. They record the failure on the instance (`host_failed`) and trap the guest instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wasmtime
from wasmtime.component import Linker, Record, Variant

from aici_cli.control.wasm.faults import Fault
from aici_cli.control.wasm.host_calls import HostCalls, current, to_u32
from aici_cli.control.wasm.signatures import STORAGE_INTERFACE, TOOLS_INTERFACE, Contract
from aici_cli.core.errors import ControllerError

if TYPE_CHECKING:
    from aici_cli.control.wasm.values import Lowering


def make_linker(wasm_engine: wasmtime.Engine, contract: Contract, lowering: Lowering) -> Linker:
    """A linker defining the functions this host provides to a component of `contract`
    (`aici:tools` only where the component imports it, as `lowering` says); `lowering`
    says which variant-like results the component wants as a `Variant`."""
    linker = Linker(wasm_engine)

    def storage_get(g: HostCalls, key: str) -> Any:
        value = g.storage_get(key)
        if lowering.storage_get:
            return Variant("none") if value is None else Variant("some", value)
        return value

    def tokens_matching(g: HostCalls, pattern: str) -> Any:
        try:
            g.count_pattern(pattern)
            handle = g.services.tokens_matching(pattern)
        except ValueError as e:
            msg = str(e) or f"invalid pattern {pattern!r}"
            return Variant("err", msg) if lowering.tokens_matching else msg
        handle = to_u32(handle, "tokens_matching")
        return Variant("ok", handle) if lowering.tokens_matching else handle

    tokenizer: dict[str, Callable[..., Any]] = {
        "vocab-size": lambda g: g.vocab_size(),
        "eos-token": lambda g: to_u32(g.services.eos_token(), "eos_token"),
        "tokenize": lambda g, text: [to_u32(t, "tokenize") for t in g.services.tokenize(text)],
        "decode": lambda g, tokens: _str(g.services.decode(list(tokens)), "decode"),
        "token-bytes": lambda g, token: bytes(g.services.token_bytes(token)),
        "tokens-matching": tokens_matching,
    }
    host: dict[str, Callable[..., Any]] = {
        "log": lambda g, message: g.log(message),
        "set-output": lambda g, key, value: g.set_output(key, value),
    }
    interfaces = [(contract.tokenizer, tokenizer), (contract.host, host)]
    if contract.forks:
        host["set-line-output"] = lambda g, key, value: g.set_line_output(key, value)
        storage: dict[str, Callable[..., Any]] = {
            "get": storage_get,
            "set": lambda g, key, value: g.storage_set(key, bytes(value)),
            "append": lambda g, key, value: to_u32(g.storage_append(key, bytes(value)),
                                                   "append"),
        }
        interfaces.append((STORAGE_INTERFACE, storage))
    if lowering.tools:
        interfaces.append((TOOLS_INTERFACE, _tools(lowering.call_tool)))
    with linker.root() as root:
        for iface, funcs in interfaces:
            with root.add_instance(iface) as inst:
                for name, fn in funcs.items():
                    inst.add_func(name, _host_function(f"{iface.split('@')[0]}.{name}", fn))
    return linker


def _tools(call_tool_tagged: bool) -> dict[str, Callable[..., Any]]:
    """`aici:tools`: `list-tools` as `tool-info` records, `call-tool`'s answer as its
    `result<string, string>` (a `Variant`: both cases are strings)."""

    def list_tools(g: HostCalls) -> list[Record]:
        records = []
        for info in g.list_tools():
            record = Record()
            # wasmtime-py reads record fields by their WIT names, hyphens included.
            for name, value in (("name", info.name), ("description", info.description),
                                ("input-schema", info.input_schema)):
                setattr(record, name, _str(value, "list_tools"))
            records.append(record)
        return records

    def call_tool(g: HostCalls, name: str, arguments: str) -> Any:
        answer = g.call_tool(name, arguments)
        text = _str(answer.text, "call_tool")
        if call_tool_tagged:
            return Variant("ok" if answer.ok else "err", text)
        return text  # not reached: wasmtime-py tags a result whose cases are both str

    return {"list-tools": list_tools, "call-tool": call_tool}


def _host_function(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a host import: finds the calling instance, contains exceptions, keeps time.

    A WasmtimeError traps the guest, and the error given to `host_failed` says why.
    """

    def call(store: Any, *args: Any) -> Any:
        guest: HostCalls | None = getattr(current, "guest", None)
        if guest is None:
            raise wasmtime.WasmtimeError(f"host function {name} called outside a runner call")
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            return fn(guest, *args)
        except Fault as e:
            error = e.error
        except Exception as e:
            error = ControllerError(
                "host_error", f"host function {name} failed: {type(e).__name__}: {e}"
            )
        finally:
            guest.host_returned(time.perf_counter() - t0, time.thread_time() - cpu0)
        guest.host_failed(error)
        raise wasmtime.WasmtimeError(error.message)

    return call


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} returned {type(value).__name__}, not str")
    return value
