"""Hostile controllers: each ends only its own sequence, with a precise error; the rest of
the batch finishes with the results it has without them; memory stays bounded; no
controller reaches host files, environment or network.

The hostile guests are small hand-written WAT behaviours (wrapped into components by
tests/support/wat.py; the batch tests run them all as one component, picked by the first
character of the controller arg), plus one real Python guest built with componentize-py
(tests/guests/sandbox_probe.py) that tries to read files, the environment and the
network. Components that import host access are refused at load (test_wasm_loading.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from fake_services import FakeServices
from paths import GUESTS
from wat import OOM_HOOK, Guest, component, save, u32s

from aici_cli.cli.main import main
from aici_cli.control.actions import Sample, StepInput, TokenSet
from aici_cli.control.wasm import (
    ControllerComponent,
    GuestInstance,
    GuestLimits,
)
from aici_cli.core.errors import ControllerError

PROBE = GUESTS / "sandbox_probe.py"
STEP = StepInput(tokens=(4,))
MIB = 1 << 20

# A 1 MiB buffer of 'x', allocated and filled on first use.
BIG = """
(global $big-at (mut i32) (i32.const 0))
(func $big (result i32)
  (if (i32.eqz (global.get $big-at))
    (then
      (global.set $big-at
        (call $realloc (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 1048576)))
      (memory.fill (global.get $big-at) (i32.const 120) (i32.const 1048576))))
  (global.get $big-at))
"""
# A fresh list of `n` u32 zeros (token 0) from the bump heap, which is never reused.
ZEROS = """
(func $zeros (param $n i32) (result i32)
  (call $realloc (i32.const 0) (i32.const 0) (i32.const 4) (i32.shl (local.get $n) (i32.const 2))))
"""

SAMPLE_ALL = Guest("(call $sample-all)")
# Recurses without end: only wasmtime's stack limit stops it.
RECURSION = Guest(
    "(drop (call $recurse (i32.const 0))) unreachable",
    funcs=("""
        (func $recurse (param $n i32) (result i32)
          (i32.add (call $recurse (i32.add (local.get $n) (i32.const 1))) (i32.const 1)))
    """,),
)
ALLOW_BEYOND = Guest("(call $sample-allow {ids})", data={"ids": u32s(5, 1_000_000)})
SPLICE_BEYOND = Guest("(call $splice (i32.const 0) {ids})", data={"ids": u32s(10, 1_000_000)})
# A bitmask of the right length with every bit set, past the vocabulary too.
FULL_BITMASK = Guest("""
    (local.set $n (i32.shr_u (i32.add (call $vocab-size) (i32.const 31)) (i32.const 5)))
    (local.set $p (call $realloc (i32.const 0) (i32.const 0) (i32.const 4)
                                 (i32.shl (local.get $n) (i32.const 2))))
    (memory.fill (local.get $p) (i32.const 255) (i32.shl (local.get $n) (i32.const 2)))
    (call $sample-bitmask (local.get $p) (local.get $n))
""")
MEGABYTE_LOGS = Guest(  # 1 MiB of log per call
    "(call $log (call $big) (i32.const 1048576)) (call $sample-all)", funcs=(BIG,)
)
EMPTY_LOG_LINES = Guest("""
    (loop $lines
      (call $log (i32.const 0) (i32.const 0))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $lines (i32.lt_u (local.get $i) (i32.const 2000))))
    (call $sample-all)
""")
MANY_OUTPUTS = Guest(  # 20 new keys per call, named by numbers: 20 * calls + i
    """
    (loop $keys
      (call $set-output
        (call $utoa (i32.add (i32.mul (global.get $calls) (i32.const 20)) (local.get $i)))
        {forty_two})
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $keys (i32.lt_u (local.get $i) (i32.const 20))))
    (call $sample-all)
    """,
    data={"forty_two": "42"},
)
LARGE_OUTPUTS = Guest(  # a 256 KiB value under a new key per call
    """
    (call $set-output (call $utoa (global.get $calls)) (call $big) (i32.const 262144))
    (call $sample-all)
    """,
    funcs=(BIG,),
)
HUGE_ERR = Guest("(call $err (call $big) (i32.const 1048576))", funcs=(BIG,))
# tokens-matching with a fresh pattern ("0", "1", ...) forever; its first err is ours.
FRESH_PATTERNS = Guest("""
    (loop $patterns
      (call $tokens-matching (call $utoa (local.get $i)) (global.get $out))
      (if (i32.load8_u (global.get $out))
        (then (return (call $err (i32.load offset=4 (global.get $out))
                                 (i32.load offset=8 (global.get $out))))))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br $patterns))
    unreachable
""")
# Grows a table 64Ki elements at a time without bound (host memory, not linear memory).
TABLE_GROWTH = Guest(
    """
    (loop $more
      (br_if $more (i32.ne (table.grow $table (ref.null func) (i32.const 65536))
                           (i32.const -1))))
    (call $handle_alloc_error)
    unreachable
    """,
    funcs=("(table $table 1 funcref)", OOM_HOOK),
)


def splice_zeros(n: int) -> Guest:
    """Splices `n` zeros on every call (4 bytes of guest memory each)."""
    return Guest(f"(call $splice (i32.const 0) (call $zeros (i32.const {n})) (i32.const {n}))",
                 funcs=(ZEROS,))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wasm-cache")


def start(cache: Path, guest: Guest, **limits: Any) -> GuestInstance:
    comp = ControllerComponent.load(save(cache, component(guest)), GuestLimits(**limits),
                                    cache_dir=cache)
    return comp.instantiate("", [1], FakeServices())


def fails(runner: GuestInstance, calls: int = 1) -> ControllerError:
    """The error that ends `runner` within `calls` mid-process calls."""
    for _ in range(calls):
        try:
            runner.mid_process(STEP)
        except ControllerError as e:
            return e
    raise AssertionError(f"no error in {calls} calls")


# --- one runner at a time ----------------------------------------------------------------


def test_deep_recursion_is_a_stack_overflow_trap(cache: Path) -> None:
    runner = start(cache, RECURSION)
    e = fails(runner)
    assert e.type == "controller_trap"
    assert e.message.startswith("mid-process trapped: stack overflow (recursion too deep?): ")
    assert "call stack exhausted" in e.message and "recurse" in e.message
    assert runner.dead


@pytest.mark.parametrize(
    ("guest", "message"),
    [
        (ALLOW_BEYOND, "sample allow: token id 1000000 is outside the vocabulary (size 100)"),
        (SPLICE_BEYOND, "splice ff-tokens: token id 1000000 is outside the vocabulary (size 100)"),
        # every bit of four words set: ids 100..127 lie past a 100-token vocabulary
        (FULL_BITMASK, "sample: bitmask allows token id 100, outside the vocabulary (size 100)"),
    ],
    ids=["allow", "splice", "bitmask"],
)
def test_token_ids_beyond_the_vocabulary(cache: Path, guest: Guest, message: str) -> None:
    e = fails(start(cache, guest))
    assert (e.type, e.message) == ("bad_action", message)


def test_megabyte_logs_keep_their_head_and_a_note(cache: Path) -> None:
    runner = start(cache, MEGABYTE_LOGS)
    for _ in range(5):
        assert runner.mid_process(STEP) == Sample(TokenSet("all"))
    # The first line is cut to fit (64 KiB, its newline included); nothing more is kept.
    assert runner.logs == ["x" * (64 * 1024 - 1), "[logs truncated: more than 65536 bytes]"]


def test_floods_of_empty_log_lines_are_bounded(cache: Path) -> None:
    # Each line counts its newline: 2000 empty lines per call cannot pile up for free.
    runner = start(cache, EMPTY_LOG_LINES, call_ms=10_000, log_bytes=1000)
    for _ in range(3):
        runner.mid_process(STEP)
    assert len(runner.logs) == 1001
    assert runner.logs[-1] == "[logs truncated: more than 1000 bytes]"


def test_thousands_of_outputs(cache: Path) -> None:
    runner = start(cache, MANY_OUTPUTS)
    e = fails(runner, calls=20)
    assert (e.type, e.message) == (
        "too_many_outputs", "set-output '276': more than 256 outputs per sequence"
    )
    assert runner.calls == 13 and len(runner.outputs) == 256


def test_large_output_values(cache: Path) -> None:
    runner = start(cache, LARGE_OUTPUTS)
    e = fails(runner, calls=10)
    assert e.type == "outputs_too_large"
    assert e.message == (
        "set-output '4': the outputs would take 1,048,580 bytes of key and value text, "
        "more than the 1 MiB allowed per sequence"
    )
    assert sorted(runner.outputs) == ["1", "2", "3"]


def test_huge_err_text_is_cut(cache: Path) -> None:
    e = fails(start(cache, HUGE_ERR))  # err of 1 MiB
    assert e.type == "controller_error"
    assert e.message == "x" * 4096 + f"... [{MIB - 4096:,} more characters cut]"


def test_fresh_patterns_forever(cache: Path) -> None:
    services = FakeServices()
    comp = ControllerComponent.load(save(cache, component(FRESH_PATTERNS)), cache_dir=cache)
    e = fails(comp.instantiate("", [1], services))
    # The guest returns the host's err as its own.
    assert (e.type, e.message) == (
        "controller_error",
        "more than 32 distinct patterns per sequence (each one scans the vocabulary); "
        "reuse the handles you have",
    )
    assert services.patterns == [str(i) for i in range(32)]  # scanned once each, no more


def test_pattern_length_is_capped(cache: Path) -> None:
    runner = start(cache, Guest("(call $stop)"), pattern_chars=10)
    with pytest.raises(ValueError, match="pattern of 11 characters; at most 10 are allowed"):
        runner.count_pattern("a" * 11)


def test_unbounded_table_growth(cache: Path) -> None:
    e = fails(start(cache, TABLE_GROWTH))
    assert e.type == "controller_memory"
    assert e.message.endswith("(tables are capped too, at 1,048,576 elements)")


def test_huge_answers(cache: Path) -> None:
    # 4 Mi tokens: wasmtime refuses to copy that much before the host sees any of it.
    e = fails(start(cache, splice_zeros(4 << 20)))
    assert e.type == "controller_trap"
    assert "too much data is being copied between the host and the guest" in e.message
    # 256 Ki tokens: copied, but converting them overran the deadline, so the guest ends
    # at its first such answer rather than slowing every step of the batch.
    e = fails(start(cache, splice_zeros(256 << 10), call_ms=20))
    assert e.type == "controller_timeout"
    assert e.message.startswith("mid-process exceeded its 20 ms deadline: it took ")
    assert "converting values between host and guest" in e.message


# --- in a batch, through `aici-batch run` ----------------------------------------------


def run_batch(model_dir: Path, controller: Path, lines: list[dict[str, Any]],
              *extra: str) -> tuple[int, dict[str, dict[str, Any]], dict[str, int]]:
    """Exit code, results by id, and each result line's size in bytes."""
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    res = CliRunner().invoke(main, [
        "run", "-", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
        "--controller", str(controller), "--batch-size", "4", "-q", *extra,
    ], input=stdin)
    by_id: dict[str, dict[str, Any]] = {}
    sizes: dict[str, int] = {}
    for text in res.stdout.splitlines():
        r = json.loads(text)
        by_id[r["id"]] = r
        sizes[r["id"]] = len(text.encode())
    assert len(by_id) == len(lines), res.output
    return res.exit_code, by_id, sizes


# The batch's one component: the first character of a line's controller_arg picks its guest.
BATCH_GUESTS = {
    "r": RECURSION,
    "B": ALLOW_BEYOND,
    "f": SPLICE_BEYOND,
    "K": FULL_BITMASK,
    "M": MEGABYTE_LOGS,
    "U": MANY_OUTPUTS,
    "V": LARGE_OUTPUTS,
    "X": HUGE_ERR,
    "P": FRESH_PATTERNS,
    "G": TABLE_GROWTH,
    "T": splice_zeros(4 << 20),  # 16 MiB of guest memory: more than wasmtime copies
    "S": splice_zeros(4096),  # the splices pile up past the chain's cap
    "A": SAMPLE_ALL,
    "a": Guest("(call $sample-allow {allow})", data={"allow": u32s(5, 7)}),
    "l": Guest(
        """
        (call $log {hello})
        (call $set-output {answer} {forty_two})
        (call $set-output {raw} {not_json})
        (call $stop)
        """,
        data={"hello": "hello", "answer": "answer", "forty_two": "42", "raw": "raw",
              "not_json": "not json"},
    ),
}


@pytest.fixture(scope="module")
def batch_controller(cache: Path) -> Path:
    return save(cache, component(BATCH_GUESTS))


# controller_arg -> (error type, a piece of its message); None: the line must finish.
HOSTILE: dict[str, tuple[str, str] | None] = {
    "r": ("controller_trap", "mid-process trapped: stack overflow (recursion too deep?)"),
    "B": ("bad_action", "sample allow: token id 1000000 is outside the vocabulary (size "),
    "f": ("bad_action", "splice ff-tokens: token id 1000000 is outside the vocabulary"),
    "K": ("bad_action", "sample: bitmask allows token id "),
    "M": None,  # logs 1 MiB per call: kept to 64 KiB
    "U": ("too_many_outputs", "more than 256 outputs per sequence"),
    "V": ("outputs_too_large", "more than the 1 MiB allowed per sequence"),
    "X": ("controller_error", "more characters cut]"),
    "P": ("controller_error", "more than 32 distinct patterns per sequence"),
    "G": ("controller_memory", "mid-process ran out of memory (cap 256 MiB)"),
    "T": ("controller_trap", "too much data is being copied between the host and the guest"),
    "S": ("bad_action", "splices forced more than 262,144 tokens without sampling"),
}
# Well-behaved modes, with a seed each so that sampling is comparable across runs.
NORMAL = {"A1": "A", "A2": "A", "A3": "A", "a": "a", "l": "l"}


def _line(id_: str, arg: str, prompt: str) -> dict[str, Any]:
    return {"id": id_, "prompt": prompt, "controller_arg": arg, "seed": len(prompt) + ord(arg),
            "temperature": 1.0}


@pytest.mark.heavy
def test_hostile_lines_end_alone_and_the_rest_is_unchanged(tiny_model_dir: Path,
                                                           batch_controller: Path) -> None:
    normal = [_line(i, arg, f"a normal line {i}") for i, arg in NORMAL.items()]
    hostile = [_line(arg, arg, f"hostile {arg}") for arg in HOSTILE]
    mixed = [x for pair in zip(hostile, normal + [None] * len(hostile)) for x in pair if x]
    # None of these modes needs the deadline to be caught: a generous one keeps a slow,
    # busy machine from turning a heavy but legal call (1 MiB of logs) into a timeout.
    args = ("--max-tokens", "16", "--controller-timeout-ms", "2000")
    code, results, sizes = run_batch(tiny_model_dir, batch_controller, mixed, *args)
    assert code == 1
    for arg, expected in HOSTILE.items():
        r = results[arg]
        if expected is None:
            assert r["finish_reason"] == "length", r.get("error")
            continue
        assert r["finish_reason"] == "error", r
        assert r["error"]["type"] == expected[0], r["error"]
        assert expected[1] in r["error"]["message"], r["error"]
        assert r["error"]["message"].startswith(f"line {r['index']}: ")
    assert results["K"]["error"]["message"].endswith(
        "outside the vocabulary (size 670)"), "the tiny vocabulary is 670, not a multiple of 32"
    assert results["U"]["stats"]["output_tokens"] == 12  # 20 keys a call: 13th call fails
    assert len(results["U"]["outputs"]) == 256
    # Nothing a guest leaves behind makes its result line unbounded.
    assert len(results["M"]["logs"]) == 64 * 1024 - 1 + len("\n[logs truncated: more than "
                                                           "65536 bytes]")
    assert sizes["M"] < 70_000
    assert sizes["V"] < MIB + 10_000  # three 256 KiB outputs, then the error
    assert sizes["X"] < 10_000  # a 1 MiB err, cut to 4096 characters
    assert max(sizes[i] for i in NORMAL) < 5_000

    code, alone, _ = run_batch(tiny_model_dir, batch_controller, normal, *args)
    assert code == 0
    for i in NORMAL:
        for key in ("text", "finish_reason", "logs", "outputs"):
            assert results[i].get(key) == alone[i].get(key), (i, key)
        assert results[i]["stats"]["output_tokens"] == alone[i]["stats"]["output_tokens"]
    assert alone["l"]["outputs"] == {"answer": 42, "raw": "not json"}


# Runs the CLI on each input file in turn, in one fresh interpreter, and prints the peak
# RSS (KiB) after each run: the peak only rises, so the second figure minus the first is
# what the second run added on top of everything the first one needed.
_PEAK_RSS = """
import resource, sys
from aici_cli.cli.main import main
n = int(sys.argv[1])
inputs, rest = sys.argv[2 : 2 + n], sys.argv[2 + n :]
for path in inputs:
    try:
        main(["run", path, "-o", path + ".out", *rest])
    except SystemExit:
        pass
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def _peak_rss_mib(model_dir: Path, tmp: Path, runs: list[list[dict[str, Any]]],
                  *args: str) -> list[float]:
    paths = []
    for k, lines in enumerate(runs):
        paths.append(tmp / f"run{k}.jsonl")
        paths[-1].write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS, str(len(paths)), *map(str, paths),
         "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
         "--batch-size", "8", "-q", *args],
        capture_output=True, text=True, timeout=300,
    )
    for path, lines in zip(paths, runs):
        out = Path(f"{path}.out")
        assert out.is_file() and len(out.read_text().splitlines()) == len(lines), proc.stderr
    return [int(line) / 1024 for line in proc.stdout.split()]


@pytest.mark.subprocess
def test_memory_stays_bounded_over_many_steps(tiny_model_dir: Path, tmp_path: Path,
                                              batch_controller: Path) -> None:
    # Eight rows that each log 1 MiB on every one of 60 steps (480 MiB if kept) beside
    # rows that pile up outputs and errors, after a run of as many quiet rows.
    quiet = [{"prompt": f"p{i}", "controller_arg": "A"} for i in range(8)]
    hostile = [{"prompt": f"p{i}", "controller_arg": "M"} for i in range(8)]
    hostile += [{"prompt": f"q{i}", "controller_arg": arg} for i, arg in enumerate("UVXUVX")]
    before, after = _peak_rss_mib(tiny_model_dir, tmp_path, [quiet, hostile],
                                  "--max-tokens", "60", "--controller", str(batch_controller))
    assert after - before < 100, f"peak RSS grew by {after - before:.0f} MiB"


# --- a real Python guest probing the sandbox --------------------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aici_cli.control.componentize import build_controller

    # A variable set while building must not reach the component either: componentize-py
    # snapshots the interpreter, environment included, at build time.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AICI_PROBE_MARKER", "leaked-from-the-build")
        out = tmp_path_factory.mktemp("probe") / "sandbox_probe.wasm"
        return build_controller(PROBE, out).out


@pytest.mark.subprocess
def test_a_python_guest_gets_nothing_of_the_host(tiny_model_dir: Path, probe: Path) -> None:
    lines = [
        {"id": "quiet", "prompt": "x", "controller_arg": "environ,getenv,recursion"},
        {"id": "file", "prompt": "x", "controller_arg": "file"},
        {"id": "listdir", "prompt": "x", "controller_arg": "listdir"},
        {"id": "connect", "prompt": "x", "controller_arg": "connect"},
        {"id": "resolve", "prompt": "x", "controller_arg": "resolve"},
        {"id": "env-then-file", "prompt": "x", "controller_arg": "environ,getenv,file"},
        {"id": "none", "prompt": "x", "controller_arg": "none"},
    ]
    code, results, _ = run_batch(tiny_model_dir, probe, lines, "--max-tokens", "8")
    assert code == 1
    for id_ in ("quiet", "none"):
        assert results[id_]["finish_reason"] == "stop", results[id_]
        assert results[id_]["text"] == " done"
    got = results["quiet"]["outputs"]
    assert got["environ"] == "{}"  # neither the host's environment nor the builder's
    assert got["getenv"] == "[None, None, None, None]"
    assert got["recursion"].startswith("error: RecursionError: maximum recursion depth")
    # Every way to the filesystem or network ends in a WASI stub, which traps: the
    # sequence ends there, having read nothing.
    for id_ in ("file", "listdir", "connect", "resolve", "env-then-file"):
        r = results[id_]
        assert r["finish_reason"] == "error", r
        assert r["error"]["type"] == "controller_trap"
        assert "a WASI function stubbed out at build time" in r["error"]["message"]
        assert r["text"] == ""
    assert results["env-then-file"]["outputs"] == {
        "environ": "{}", "getenv": "[None, None, None, None]"
    }
