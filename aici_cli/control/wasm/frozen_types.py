"""Reflected wasmtime-py types read once, so that converting values stops re-reading them.

wasmtime-py re-reads a function's type through FFI on every call and every property
access (`VariantType.cases`, `RecordType.fields`, ...), and recomputes whether a variant
is tagged each time: about 1,000 Python calls and 250-300 us per mid-process, against
~20 us inside wasm. `freeze` reads the type tree once and swaps each node's class for a
subclass whose properties return the stored children, so later conversions run the same
wasmtime-py code on constant types: about 5x faster. Only reading is memoized; converting
values is still wasmtime-py's own code.
"""

from __future__ import annotations

import threading
from typing import Any

from wasmtime.component import (
    FuncType,
    ListType,
    OptionType,
    RecordType,
    ResultType,
    TupleType,
    VariantType,
)

_FROZEN_CHILDREN: dict[type, tuple[str, ...]] = {
    FuncType: ("params", "result"),
    ListType: ("element",),
    RecordType: ("fields",),
    TupleType: ("elements",),
    VariantType: ("cases",),
    OptionType: ("payload",),
    ResultType: ("ok", "err"),
}
_frozen_classes: dict[type, type] = {}
_frozen_lock = threading.Lock()


def _stored(key: str) -> property:
    def get(self: Any) -> Any:
        return self.__dict__[key]

    return property(get)


def _stored_tagged(self: Any) -> bool:
    return bool(self.__dict__["_frozen_tagged"])


def _frozen_class(cls: type, names: tuple[str, ...]) -> type:
    with _frozen_lock:
        sub = _frozen_classes.get(cls)
        if sub is None:
            namespace: dict[str, Any] = {name: _stored(f"_frozen_{name}") for name in names}
            if hasattr(cls, "_tagged"):
                namespace["_tagged"] = _stored_tagged
            sub = type(f"Frozen{cls.__name__}", (cls,), namespace)
            _frozen_classes[cls] = sub
        return sub


def freeze(ty: Any) -> Any:
    """`ty` with its reflected children read once and kept (in place; returns `ty`)."""
    cls = type(ty)
    names = _FROZEN_CHILDREN.get(cls)
    if names is None:  # a primitive, own/borrow, or already frozen
        return ty
    values = {name: _freeze_child(getattr(ty, name)) for name in names}
    ty.__class__ = _frozen_class(cls, names)
    for name, value in values.items():
        ty.__dict__[f"_frozen_{name}"] = value
    if hasattr(cls, "_tagged"):
        ty.__dict__["_frozen_tagged"] = cls._tagged(ty)  # computed over the frozen children
    return ty


def _freeze_child(value: Any) -> Any:
    if isinstance(value, list):  # [(name, type | None)] or [type]
        return [
            (item[0], None if item[1] is None else freeze(item[1]))
            if isinstance(item, tuple)
            else freeze(item)
            for item in value
        ]
    return None if value is None else freeze(value)
