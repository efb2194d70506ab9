"""Controller components in WebAssembly text, written next to the tests that run them.

`component(Guest(...))` wraps the core-module code of one behaviour into a component of
world `aici:controller/controller-world@0.1.0` (tests/data/wit-0.1.0/controller.wit), or
with `version="0.2.0"` of the current contract (wit/controller.wit: `fork`, the step's
`branch`, `set-line-output` and `aici:storage`), with the canonical ABI written out, so the
tests need no componentize-py build:

    stop = Guest("(call $stop)")
    allow = Guest("(call $sample-allow {allow})", data={"allow": u32s(5, 7)})
    path = save(tmp_path, component(allow))

`component({"a": allow, "s": stop})` makes one component of several behaviours, picked
by the first character of the constructor's `arg` (the batch tests run one component
over many lines); another first character traps.

What a guest's code can use (it is the body of the core function behind `mid-process`,
and must leave the address of its answer, which the `$stop`... helpers return):
- params `$backtrack`, `$tokens`, `$tokens-len`, `$has-text`, `$text`, `$text-len` (the
  step input, lowered; 0.2.0 adds `$has-branch`, `$branch`), and locals `$i`, `$p`, `$n`
  (i32, zero);
- `{name}`: the (address, length) pair of `data[name]`: a string (UTF-8), bytes, a
  `u32s(...)` list or a `strings(...)` list;
- answers: `$stop`, `$sample-all`, `$sample-allow (ptr len)`, `$sample-bitmask (ptr len)`,
  `$sample-host-set (handle)`, `$splice (backtrack ptr len)`, `$err (ptr len)`,
  `$generate (grammar ptr len max-tokens stop-ptr stop-len)`, grammar being the case of
  WIT `grammar`: 0 json-schema, 1 regex, 2 lark, 3 choice, and in 0.2.0 `$fork (n)`;
- the contract's imports by their WIT names (`$log`, `$set-output`, `$vocab-size`,
  `$eos-token`, `$tokenize`, `$decode`, `$token-bytes`, `$tokens-matching`; in 0.2.0 also
  `$set-line-output` and storage's `$get`, `$set`, `$append`; in any version
  `aici:tools`' `$list-tools` and `$call-tool`), lowered: a component imports those its
  code calls, and no others. Imports that return a list, a string, an option or a result
  write it to `(global.get $out)` (16 bytes; a `tool-info` is 24 bytes: three (address,
  length) pairs);
- `$realloc`, the guest's bump allocator (nothing is ever freed: a runner lives for one
  sequence), `(global.get $calls)`: mid-process calls so far, this one included, and
  `$utoa (value) -> (ptr len)`: a number as decimal text (valid until the next call).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class U32s:
    values: tuple[int, ...]


@dataclass(frozen=True)
class Strings:
    values: tuple[str, ...]


Data = str | bytes | U32s | Strings


def u32s(*values: int) -> U32s:
    """A `list<u32>` constant: `{name}` is its address and its number of elements."""
    return U32s(values)


def strings(*values: str) -> Strings:
    """A `list<string>` constant: `{name}` is its address and its number of strings."""
    return Strings(values)


@dataclass(frozen=True)
class Guest:
    """One behaviour of a controller guest, as core-module code (see the module doc)."""

    mid_process: str
    data: Mapping[str, Data] = field(default_factory=dict)
    funcs: tuple[str, ...] = ()  # more module fields (functions, globals, tables) it calls
    constructor: str = ""  # instructions run first in the constructor, e.g. `unreachable`


# A function named like Rust's allocation-failure hook: the host recognises the name in a
# trap's backtrace and reports `controller_memory`.
OOM_HOOK = "(func $handle_alloc_error unreachable)"


def save(directory: Path, text: str) -> Path:
    """Writes a component's text to a file named by its hash; returns the path."""
    path = directory / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.wat"
    path.write_text(text)
    return path


def component(guests: Guest | Mapping[str, Guest], version: str = "0.1.0") -> str:
    """The text of a controller component of contract `version` running `guests` (one,
    or one per first character of the constructor's `arg`)."""
    forks = version != "0.1.0"
    by_mode = {None: guests} if isinstance(guests, Guest) else dict(guests)
    code: list[str] = []
    data: list[str] = []
    funcs: list[str] = []
    at = _DATA_START
    for k, (mode, guest) in enumerate(by_mode.items()):
        pairs, segments, at = _place(guest.data, at)
        data += segments
        funcs += [f for f in guest.funcs if f not in funcs]
        code.append(_behaviour(k, mode, guest, pairs, forks))
    body = "\n".join(data + funcs + code + [_dispatch(list(by_mode), forks)])
    used = [name for name in _IMPORTS if re.search(rf"\${re.escape(name)}(?![\w-])", body)]
    heap = (at + 15) // 16 * 16
    return _COMPONENT.format(
        version=version,
        types=_TYPES_0_2 if forks else _TYPES_0_1,
        step_input_t=_STEP_INPUT_T.format(branch=' (field "branch" (option u32))' if forks
                                          else ""),
        action_t=_ACTION_T.format(fork=' (case "fork" u32)' if forks else ""),
        imports=_component_imports(used, version),
        lowered=_lowered(used),
        heap=heap,
        pages=heap // 65536 + 1,
        core_imports=_core_imports(used),
        prelude=_PRELUDE,
        body=body,
        with_imports=_with_imports(used),
    )


# --- layout -----------------------------------------------------------------------------

# Guest memory: 16..63 the answer (result<action, string>), 64..79 `$out`, 80..95 the
# digits of `$utoa`, constants from 96, then the heap.
_ANSWER = 16
_OUT = 64
_DIGITS_END = 96
_DATA_START = 96


def _place(data: Mapping[str, Data], at: int) -> tuple[dict[str, str], list[str], int]:
    """Lays constants out from `at`: ({name: "(i32.const addr) (i32.const len)"}, data
    segments, the next free address)."""
    pairs: dict[str, str] = {}
    segments: list[str] = []
    for name, value in data.items():
        if isinstance(value, Strings):  # (address, length) pairs, then the texts
            texts = [text.encode() for text in value.values]
            blob, text_at = b"", at + 8 * len(texts)
            for text in texts:
                blob += text_at.to_bytes(4, "little") + len(text).to_bytes(4, "little")
                text_at += len(text)
            blob += b"".join(texts)
            count = len(texts)
        elif isinstance(value, U32s):
            blob = b"".join(v.to_bytes(4, "little") for v in value.values)
            count = len(value.values)
        else:
            blob = value.encode() if isinstance(value, str) else value
            count = len(blob)
        pairs[name] = f"(i32.const {at}) (i32.const {count})"
        escaped = "".join(f"\\{b:02x}" for b in blob)
        segments.append(f'(data (i32.const {at}) "{escaped}")')
        at = (at + len(blob) + 3) // 4 * 4
    return pairs, segments, at


def _behaviour(k: int, mode: str | None, guest: Guest, pairs: dict[str, str],
               forks: bool) -> str:
    """The core functions of one guest: its constructor part and its mid-process."""
    mid = guest.mid_process.format_map(pairs)
    ctor = guest.constructor.format_map(pairs)
    branch = " (param $has-branch i32) (param $branch i32)" if forks else ""
    return (
        f"(func $constructor-{k}\n{ctor})\n"
        f"(func $mid-process-{k} (param $backtrack i32) (param $tokens i32) "
        "(param $tokens-len i32) (param $has-text i32) (param $text i32) (param $text-len i32)"
        f"{branch} (result i32) (local $i i32) (local $p i32) (local $n i32)\n"
        f"{mid})"
    )


def _dispatch(modes: list[str | None], forks: bool) -> str:
    """The exported core functions: each runs the guest of the arg's first character."""
    ctor, mid = [], []
    params = 8 if forks else 6
    args = "".join(f" (local.get {i})" for i in range(1, params + 1))
    for k, mode in enumerate(modes):
        test = "(i32.const 1)" if mode is None else (
            f"(i32.eq (global.get $mode) (i32.const {ord(mode)}))"
        )
        ctor.append(f"(if {test} (then (call $constructor-{k})))")
        mid.append(f"(if {test} (then (return (call $mid-process-{k}{args}))))")
    return f"""
(func (export "ctor") (param $arg i32) (param $arg-len i32) (param $prompt i32)
                      (param $prompt-len i32) (result i32)
  (if (local.get $arg-len) (then (global.set $mode (i32.load8_u (local.get $arg)))))
  {" ".join(ctor)}
  (call $runner-new (i32.const 1)))
(func (export "mid-process") (param $self i32) (param {" ".join(["i32"] * params)}) (result i32)
  (global.set $calls (i32.add (global.get $calls) (i32.const 1)))
  {" ".join(mid)}
  unreachable)"""


# --- imports ----------------------------------------------------------------------------

# WIT name -> (interface, component-level type, core signature, canon options)
_IMPORTS: dict[str, tuple[str, str, str, str]] = {
    "vocab-size": ("tokenizer", "(func (result u32))", "(result i32)", ""),
    "eos-token": ("tokenizer", "(func (result u32))", "(result i32)", ""),
    "tokenize": ("tokenizer", '(func (param "text" string) (result (list u32)))',
                 "(param i32 i32 i32)", "(memory $memory) (realloc $realloc) string-encoding=utf8"),
    "decode": ("tokenizer", '(func (param "tokens" (list u32)) (result string))',
               "(param i32 i32 i32)", "(memory $memory) (realloc $realloc) string-encoding=utf8"),
    "token-bytes": ("tokenizer", '(func (param "token" u32) (result (list u8)))',
                    "(param i32 i32)", "(memory $memory) (realloc $realloc)"),
    "tokens-matching": (
        "tokenizer", '(func (param "pattern" string) (result (result u32 (error string))))',
        "(param i32 i32 i32)", "(memory $memory) (realloc $realloc) string-encoding=utf8",
    ),
    "log": ("host", '(func (param "message" string))', "(param i32 i32)",
            "(memory $memory) string-encoding=utf8"),
    "set-output": ("host", '(func (param "key" string) (param "value" string))',
                   "(param i32 i32 i32 i32)", "(memory $memory) string-encoding=utf8"),
    # 0.2.0 only
    "set-line-output": ("host", '(func (param "key" string) (param "value" string))',
                        "(param i32 i32 i32 i32)", "(memory $memory) string-encoding=utf8"),
    "get": ("storage", '(func (param "key" string) (result (option (list u8))))',
            "(param i32 i32 i32)", "(memory $memory) (realloc $realloc) string-encoding=utf8"),
    "set": ("storage", '(func (param "key" string) (param "value" (list u8)))',
            "(param i32 i32 i32 i32)", "(memory $memory) string-encoding=utf8"),
    "append": ("storage", '(func (param "key" string) (param "value" (list u8)) (result u32))',
               "(param i32 i32 i32 i32) (result i32)", "(memory $memory) string-encoding=utf8"),
    # aici:tools, any version
    "list-tools": ("tools", "(func (result (list $tool-info)))", "(param i32)",
                   "(memory $memory) (realloc $realloc) string-encoding=utf8"),
    "call-tool": ("tools", '(func (param "name" string) (param "arguments" string) '
                           "(result (result string (error string))))",
                  "(param i32 i32 i32 i32 i32)",
                  "(memory $memory) (realloc $realloc) string-encoding=utf8"),
}
_INTERFACES = ("tokenizer", "host", "storage", "tools")
_VERSIONED_APART = {"storage": "aici:storage/storage@0.1.0", "tools": "aici:tools/tools@0.1.0"}
# Types an interface's functions name, declared in its instance type before them.
_INSTANCE_TYPES = {
    "tools": '    (type $tool-info-t (record (field "name" string) (field "description" string)\n'
             '                               (field "input-schema" string)))\n'
             '    (export "tool-info" (type $tool-info (eq $tool-info-t)))',
}


def _component_imports(used: list[str], version: str) -> str:
    lines = []
    for iface in _INTERFACES:
        funcs = [f'    (export "{n}" {_IMPORTS[n][1]})' for n in used if _IMPORTS[n][0] == iface]
        name = _VERSIONED_APART.get(iface, f"aici:controller/{iface}@{version}")
        types = [_INSTANCE_TYPES[iface]] if iface in _INSTANCE_TYPES else []
        if funcs:
            lines.append(f'  (import "{name}" (instance ${iface}\n'
                         + "\n".join(types + funcs) + "\n  ))")
    return "\n".join(lines)


def _lowered(used: list[str]) -> str:
    return "\n".join(
        f'  (core func $core-{n} (canon lower (func ${_IMPORTS[n][0]} "{n}") {_IMPORTS[n][3]}))'
        for n in used
    )


def _core_imports(used: list[str]) -> str:
    return "\n".join(
        f'    (import "{_IMPORTS[n][0]}" "{n}" (func ${n} {_IMPORTS[n][2]}))' for n in used
    )


def _with_imports(used: list[str]) -> str:
    parts = []
    for iface in _INTERFACES:
        funcs = [f'(export "{n}" (func $core-{n}))' for n in used if _IMPORTS[n][0] == iface]
        if funcs:
            parts.append(f'    (with "{iface}" (instance {" ".join(funcs)}))')
    return "\n".join(parts)


# --- the fixed parts --------------------------------------------------------------------

_PRELUDE = f"""
    (global $mode (mut i32) (i32.const 0))
    (global $calls (mut i32) (i32.const 0))
    (global $out i32 (i32.const {_OUT}))

    ;; result<action, string> at {_ANSWER}: ok/err byte, then the action: its case byte
    ;; at +4, its payload from +8.
    (func $stop (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 4}) (i32.const 3))
      (i32.const {_ANSWER}))
    (func $sample (param $set i32) (param $a i32) (param $b i32) (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 4}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 8}) (local.get $set))
      (i32.store (i32.const {_ANSWER + 12}) (local.get $a))
      (i32.store (i32.const {_ANSWER + 16}) (local.get $b))
      (i32.const {_ANSWER}))
    (func $sample-all (result i32)
      (call $sample (i32.const 0) (i32.const 0) (i32.const 0)))
    (func $sample-allow (param $ptr i32) (param $len i32) (result i32)
      (call $sample (i32.const 1) (local.get $ptr) (local.get $len)))
    (func $sample-bitmask (param $ptr i32) (param $len i32) (result i32)
      (call $sample (i32.const 3) (local.get $ptr) (local.get $len)))
    (func $sample-host-set (param $handle i32) (result i32)
      (call $sample (i32.const 4) (local.get $handle) (i32.const 0)))
    (func $splice (param $backtrack i32) (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 4}) (i32.const 2))
      (i32.store (i32.const {_ANSWER + 8}) (local.get $backtrack))
      (i32.store (i32.const {_ANSWER + 12}) (local.get $ptr))
      (i32.store (i32.const {_ANSWER + 16}) (local.get $len))
      (i32.const {_ANSWER}))
    (func $generate (param $grammar i32) (param $ptr i32) (param $len i32) (param $max i32)
                    (param $stop i32) (param $stop-len i32) (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 4}) (i32.const 1))
      (i32.store8 (i32.const {_ANSWER + 8}) (i32.const 1))  ;; option: some
      (i32.store8 (i32.const {_ANSWER + 12}) (local.get $grammar))
      (i32.store (i32.const {_ANSWER + 16}) (local.get $ptr))
      (i32.store (i32.const {_ANSWER + 20}) (local.get $len))
      (i32.store (i32.const {_ANSWER + 24}) (local.get $max))
      (i32.store (i32.const {_ANSWER + 28}) (local.get $stop))
      (i32.store (i32.const {_ANSWER + 32}) (local.get $stop-len))
      (i32.const {_ANSWER}))
    (func $fork (param $n i32) (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 0))
      (i32.store8 (i32.const {_ANSWER + 4}) (i32.const 4))
      (i32.store (i32.const {_ANSWER + 8}) (local.get $n))
      (i32.const {_ANSWER}))
    (func $err (param $ptr i32) (param $len i32) (result i32)
      (i32.store8 (i32.const {_ANSWER}) (i32.const 1))
      (i32.store (i32.const {_ANSWER + 4}) (local.get $ptr))
      (i32.store (i32.const {_ANSWER + 8}) (local.get $len))
      (i32.const {_ANSWER}))
    (func $utoa (param $v i32) (result i32 i32)
      (local $p i32)
      (local.set $p (i32.const {_DIGITS_END}))
      (loop $digits
        (local.set $p (i32.sub (local.get $p) (i32.const 1)))
        (i32.store8 (local.get $p)
          (i32.add (i32.const 48) (i32.rem_u (local.get $v) (i32.const 10))))
        (local.set $v (i32.div_u (local.get $v) (i32.const 10)))
        (br_if $digits (local.get $v)))
      (local.get $p)
      (i32.sub (i32.const {_DIGITS_END}) (local.get $p)))
"""

# Memory and allocator live in their own core module so that the imports can be lowered
# against the memory before the main module is instantiated. Exported functions may only
# mention types that have names where they are exported, so the interface is assembled
# in a nested component that imports the types and functions and re-exports them under
# their WIT names (what wit-component does too).
_COMPONENT = """(component
  (type $types-t
    (instance
{types}
    )
  )
  (import "aici:controller/types@{version}" (instance $types (type $types-t)))
  (alias export $types "token-id" (type $token-id))
  (alias export $types "step-input" (type $step-input))
  (alias export $types "action" (type $action))
{imports}

  (core module $Mem
    (memory (export "memory") {pages})
    (global $heap (mut i32) (i32.const {heap}))
    (func (export "realloc") (param $old i32) (param $old_size i32) (param $align i32)
                             (param $size i32) (result i32)
      (local $ptr i32) (local $end i32) (local $have i32)
      (local.set $ptr
        (i32.and (i32.add (global.get $heap) (i32.sub (local.get $align) (i32.const 1)))
                 (i32.sub (i32.const 0) (local.get $align))))
      (local.set $end (i32.add (local.get $ptr) (local.get $size)))
      (local.set $have (i32.mul (memory.size) (i32.const 65536)))
      (if (i32.gt_u (local.get $end) (local.get $have))
        (then  ;; grow by the pages missing, plus one; trap when memory cannot grow
          (if (i32.eq (memory.grow (i32.add (i32.shr_u (i32.sub (local.get $end) (local.get $have))
                                                       (i32.const 16))
                                            (i32.const 1)))
                      (i32.const -1))
            (then unreachable))))
      (if (local.get $old_size)
        (then (memory.copy (local.get $ptr) (local.get $old) (local.get $old_size))))
      (global.set $heap (local.get $end))
      (local.get $ptr))
  )
  (core instance $mem (instantiate $Mem))
  (alias core export $mem "memory" (core memory $memory))
  (alias core export $mem "realloc" (core func $realloc))
{lowered}

  (type $runner (resource (rep i32)))
  (core func $runner-new (canon resource.new $runner))

  (core module $Main
    (import "env" "memory" (memory 1))
    (import "env" "realloc" (func $realloc (param i32 i32 i32 i32) (result i32)))
    (import "env" "runner-new" (func $runner-new (param i32) (result i32)))
{core_imports}
{prelude}
{body}
  )
  (core instance $main (instantiate $Main
    (with "env" (instance
      (export "memory" (memory $memory))
      (export "realloc" (func $realloc))
      (export "runner-new" (func $runner-new))))
{with_imports}
  ))

  (func $ctor (param "arg" string) (param "prompt" (list $token-id)) (result (own $runner))
    (canon lift (core func $main "ctor") (memory $memory) (realloc $realloc) string-encoding=utf8))
  (func $mid-process (param "self" (borrow $runner)) (param "input" $step-input)
                     (result (result $action (error string)))
    (canon lift (core func $main "mid-process") (memory $memory) (realloc $realloc)
      string-encoding=utf8))

  (component $Controller
    (type $u32 u32)
    (import "token-id" (type $token-id' (eq $u32)))
{step_input_t}
    (import "step-input" (type $step-input' (eq $step-input-t)))
    (type $token-set-t (variant (case "all") (case "allow" (list $token-id'))
                                (case "deny" (list $token-id')) (case "bitmask" (list u32))
                                (case "host-set" u32) (case "not-host-set" u32)))
    (import "token-set" (type $token-set' (eq $token-set-t)))
    (type $grammar-t (variant (case "json-schema" string) (case "regex" string)
                              (case "lark" string) (case "choice" (list string))))
    (import "grammar" (type $grammar' (eq $grammar-t)))
    (type $segment-t (record (field "grammar" (option $grammar')) (field "max-tokens" u32)
                             (field "stop" (list string))))
    (import "segment" (type $segment' (eq $segment-t)))
    (type $splice-t (record (field "backtrack" u32) (field "ff-tokens" (list $token-id'))))
    (import "splice" (type $splice' (eq $splice-t)))
{action_t}
    (import "action" (type $action' (eq $action-t)))
    (import "runner" (type $runner' (sub resource)))
    (import "ctor" (func $ctor' (param "arg" string) (param "prompt" (list $token-id'))
                                (result (own $runner'))))
    (import "mid-process" (func $mid-process' (param "self" (borrow $runner'))
                                              (param "input" $step-input')
                                              (result (result $action' (error string)))))
    (export $token-id-e "token-id" (type $token-id'))
    (export $step-input-e "step-input" (type $step-input'))
    (export $action-e "action" (type $action'))
    (export $runner-e "runner" (type $runner'))
    (export "[constructor]runner" (func $ctor')
      (func (param "arg" string) (param "prompt" (list $token-id-e)) (result (own $runner-e))))
    (export "[method]runner.mid-process" (func $mid-process')
      (func (param "self" (borrow $runner-e)) (param "input" $step-input-e)
            (result (result $action-e (error string)))))
  )
  (alias export $types "token-set" (type $token-set))
  (alias export $types "grammar" (type $grammar))
  (alias export $types "segment" (type $segment))
  (alias export $types "splice" (type $splice))
  (instance $controller (instantiate $Controller
    (with "token-id" (type $token-id))
    (with "step-input" (type $step-input))
    (with "token-set" (type $token-set))
    (with "grammar" (type $grammar))
    (with "segment" (type $segment))
    (with "splice" (type $splice))
    (with "action" (type $action))
    (with "runner" (type $runner))
    (with "ctor" (func $ctor))
    (with "mid-process" (func $mid-process))))
  (export "aici:controller/controller@{version}" (instance $controller))
)
"""

_TYPES_0_1 = """\
      (type u32)
      (export "token-id" (type (eq 0)))
      (type (list 1))
      (type (option string))
      (type (record (field "backtrack" u32) (field "tokens" 2) (field "segment-text" 3)))
      (export "step-input" (type (eq 4)))
      (type (list u32))
      (type (variant (case "all") (case "allow" 2) (case "deny" 2) (case "bitmask" 6)
                     (case "host-set" u32) (case "not-host-set" u32)))
      (export "token-set" (type (eq 7)))
      (type (list string))
      (type (variant (case "json-schema" string) (case "regex" string) (case "lark" string)
                     (case "choice" 9)))
      (export "grammar" (type (eq 10)))
      (type (option 11))
      (type (record (field "grammar" 12) (field "max-tokens" u32) (field "stop" 9)))
      (export "segment" (type (eq 13)))
      (type (record (field "backtrack" u32) (field "ff-tokens" 2)))
      (export "splice" (type (eq 15)))
      (type (variant (case "sample" 8) (case "generate" 14) (case "splice" 16) (case "stop")))
      (export "action" (type (eq 17)))"""

# 0.2.0: `option<u32>` first (type 0), so the others move up by one; step-input gains
# `branch`, action gains `fork`.
_TYPES_0_2 = """\
      (type (option u32))
      (type u32)
      (export "token-id" (type (eq 1)))
      (type (list 2))
      (type (option string))
      (type (record (field "backtrack" u32) (field "tokens" 3) (field "segment-text" 4)
                    (field "branch" 0)))
      (export "step-input" (type (eq 5)))
      (type (list u32))
      (type (variant (case "all") (case "allow" 3) (case "deny" 3) (case "bitmask" 7)
                     (case "host-set" u32) (case "not-host-set" u32)))
      (export "token-set" (type (eq 8)))
      (type (list string))
      (type (variant (case "json-schema" string) (case "regex" string) (case "lark" string)
                     (case "choice" 10)))
      (export "grammar" (type (eq 11)))
      (type (option 12))
      (type (record (field "grammar" 13) (field "max-tokens" u32) (field "stop" 10)))
      (export "segment" (type (eq 14)))
      (type (record (field "backtrack" u32) (field "ff-tokens" 3)))
      (export "splice" (type (eq 16)))
      (type (variant (case "sample" 9) (case "generate" 15) (case "splice" 17) (case "stop")
                     (case "fork" u32)))
      (export "action" (type (eq 18)))"""

_STEP_INPUT_T = """\
    (type $step-input-t (record (field "backtrack" u32) (field "tokens" (list $token-id'))
                                (field "segment-text" (option string)){branch}))"""

_ACTION_T = """\
    (type $action-t (variant (case "sample" $token-set') (case "generate" $segment')
                             (case "splice" $splice') (case "stop"){fork}))"""
