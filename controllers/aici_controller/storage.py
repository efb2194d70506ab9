"""The line's storage: bytes under string keys, shared by every branch of the line.

    from aici_controller import storage

    storage.append("votes", answer + "\\n")    # returns the value's new length in bytes
    votes = (storage.get("votes") or b"").decode().splitlines()

A write applies at once, and every later step of any branch of the line sees it; the
host steps one branch at a time (the README's "Storage" section gives the order). The
storage starts empty for each input line. A line may hold 256 keys and 1 MiB of keys and
values; a write past that ends the line with `storage_quota`.

Values are bytes; `str` values are stored as UTF-8.
"""

from __future__ import annotations

from . import _host

__all__ = ["append", "get", "set"]


def get(key: str) -> bytes | None:
    """The value under `key`, or None when it was never set."""
    return _host.current().storage_get(_key(key))


def set(key: str, value: bytes | str) -> None:  # noqa: A001 (the WIT name)
    """Set `key` to `value`."""
    _host.current().storage_set(_key(key), _value(value, "set"))


def append(key: str, value: bytes | str) -> int:
    """Append `value` to `key`'s value (empty if unset); returns the new length in bytes."""
    return _host.current().storage_append(_key(key), _value(value, "append"))


def _key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"storage keys are str, got {type(key).__name__}")
    return key


def _value(value: object, where: str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"storage.{where}() takes bytes or str, got {type(value).__name__}")
