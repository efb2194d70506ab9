"""Hostile controllers: each ends only its own sequence, with a precise error; the rest of
the batch finishes with the results it has without them; memory stays bounded; no
controller reaches host files, environment or network.

The hostile behaviours are modes of the hand-written WAT component
(tests/wat/controller.wat, picked by the first byte of the controller arg), plus one real
Python guest built with componentize-py (tests/guests/sandbox_probe.py) that tries to
read files, the environment and the network.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from aici_cli.cli import main
from aici_cli.control.actions import Sample, StepInput, TokenSet
from aici_cli.control.wasm import (
    ComponentError,
    ControllerComponent,
    GuestInstance,
    Limits,
)
from aici_cli.errors import ControllerError

HERE = Path(__file__).resolve().parent
WAT = HERE / "wat" / "controller.wat"
PROBE = HERE / "guests" / "sandbox_probe.py"
STEP = StepInput(tokens=(4,))
MIB = 1 << 20


class Vocab100:
    """Tokenizer services for a 100-token vocabulary; records the patterns it scanned."""

    def __init__(self) -> None:
        self.patterns: list[str] = []

    def vocab_size(self) -> int:
        return 100

    def eos_token(self) -> int:
        return 2

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) % 100 for c in text]

    def decode(self, tokens: list[int]) -> str:
        return "".join(f"<{t}>" for t in tokens)

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def tokens_matching(self, pattern: str) -> int:
        self.patterns.append(pattern)
        return len(self.patterns)

    def has_host_set(self, handle: int) -> bool:
        return 0 < handle <= len(self.patterns)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wasm-cache")


def component(cache: Path, **limits: Any) -> ControllerComponent:
    return ControllerComponent.load(WAT, Limits(**limits), cache_dir=cache)


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
    runner = component(cache).instantiate("r", [1], Vocab100())
    e = fails(runner)
    assert e.type == "controller_trap"
    assert e.message.startswith("mid-process trapped: stack overflow (recursion too deep?): ")
    assert "call stack exhausted" in e.message and "recurse" in e.message
    assert runner.dead


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("B", "sample allow: token id 1000000 is outside the vocabulary (size 100)"),
        ("f", "splice ff-tokens: token id 1000000 is outside the vocabulary (size 100)"),
        # every bit of four words set: ids 100..127 lie past a 100-token vocabulary
        ("K", "sample: bitmask allows token id 100, outside the vocabulary (size 100)"),
    ],
)
def test_token_ids_beyond_the_vocabulary(cache: Path, mode: str, message: str) -> None:
    e = fails(component(cache).instantiate(mode, [1], Vocab100()))
    assert (e.type, e.message) == ("bad_action", message)


def test_megabyte_logs_keep_their_head_and_a_note(cache: Path) -> None:
    runner = component(cache).instantiate("M", [1], Vocab100())  # 1 MiB per call
    for _ in range(5):
        assert runner.mid_process(STEP) == Sample(TokenSet("all"))
    # The first line is cut to fit (64 KiB, its newline included); nothing more is kept.
    assert runner.logs == ["x" * (64 * 1024 - 1), "[logs truncated: more than 65536 bytes]"]


def test_floods_of_empty_log_lines_are_bounded(cache: Path) -> None:
    # Each line counts its newline: 2000 empty lines per call cannot pile up for free.
    runner = component(cache, call_ms=10_000, log_bytes=1000).instantiate("E", [1], Vocab100())
    for _ in range(3):
        runner.mid_process(STEP)
    assert len(runner.logs) == 1001
    assert runner.logs[-1] == "[logs truncated: more than 1000 bytes]"


def test_thousands_of_outputs(cache: Path) -> None:
    runner = component(cache).instantiate("U", [1], Vocab100())  # 20 new keys per call
    e = fails(runner, calls=20)
    assert (e.type, e.message) == (
        "too_many_outputs", "set-output '276': more than 256 outputs per sequence"
    )
    assert runner.calls == 13 and len(runner.outputs) == 256


def test_large_output_values(cache: Path) -> None:
    runner = component(cache).instantiate("V", [1], Vocab100())  # 256 KiB per call
    e = fails(runner, calls=10)
    assert e.type == "outputs_too_large"
    assert e.message == (
        "set-output '4': the outputs would take 1,048,580 bytes of key and value text, "
        "more than the 1 MiB allowed per sequence"
    )
    assert sorted(runner.outputs) == ["1", "2", "3"]


def test_huge_err_text_is_cut(cache: Path) -> None:
    e = fails(component(cache).instantiate("X", [1], Vocab100()))  # err of 1 MiB
    assert e.type == "controller_error"
    assert e.message == "x" * 4096 + f"... [{MIB - 4096:,} more characters cut]"


def test_fresh_patterns_forever(cache: Path) -> None:
    services = Vocab100()
    e = fails(component(cache).instantiate("P", [1], services))
    # The guest returns the host's err as its own.
    assert (e.type, e.message) == (
        "controller_error",
        "more than 32 distinct patterns per sequence (each one scans the vocabulary); "
        "reuse the handles you have",
    )
    assert services.patterns == [str(i) for i in range(32)]  # scanned once each, no more


def test_pattern_length_is_capped(cache: Path) -> None:
    runner = component(cache, pattern_chars=10).instantiate("s", [1], Vocab100())
    with pytest.raises(ValueError, match="pattern of 11 characters; at most 10 are allowed"):
        runner._count_pattern("a" * 11)


def test_unbounded_table_growth(cache: Path) -> None:
    e = fails(component(cache).instantiate("G", [1], Vocab100()))
    assert e.type == "controller_memory"
    assert e.message.endswith("(tables are capped too, at 1,048,576 elements)")


def test_huge_answers(cache: Path) -> None:
    # 4 Mi tokens: wasmtime refuses to copy that much before the host sees any of it.
    e = fails(component(cache).instantiate("T", [1], Vocab100()))
    assert e.type == "controller_trap"
    assert "too much data is being copied between the host and the guest" in e.message
    # 256 Ki tokens: copied, but converting them overran the deadline, so the guest ends
    # at its first such answer rather than slowing every step of the batch.
    e = fails(component(cache, call_ms=20).instantiate("Y", [1], Vocab100()))
    assert e.type == "controller_timeout"
    assert e.message.startswith("mid-process exceeded its 20 ms deadline: it took ")
    assert "converting values between host and guest" in e.message


# --- what a component may import -------------------------------------------------------

_EXPORT = """
  (instance $controller)
  (export "aici:controller/controller@0.1.0" (instance $controller))
"""


def _component_importing(*imports: str) -> str:
    return "(component\n" + "\n".join(imports) + _EXPORT + ")\n"


def _instance(name: str, func: str = "get", result: str = "(list string)") -> str:
    return f'(import "{name}" (instance (export "{func}" (func (result {result})))))'


@pytest.mark.parametrize(
    ("imports", "message"),
    [
        ([_instance("wasi:filesystem/preopens@0.2.0", "get-directories")],
         "imports wasi:filesystem/preopens@0.2.0, but controllers get no filesystem"),
        ([_instance("wasi:sockets/instance-network@0.2.0", "instance-network", "u32")],
         "imports wasi:sockets/instance-network@0.2.0, but controllers get no filesystem"),
        ([_instance("wasi:cli/environment@0.2.0", "get-environment")],
         "imports wasi:cli/environment@0.2.0, but"),
        ([_instance("wasi:http/outgoing-handler@0.2.0", "handle", "u32"),
          _instance("wasi:random/random@0.2.0", "get-random-u64", "u64"),
          _instance("wasi:clocks/wall-clock@0.2.0", "now", "u64")],
         "imports wasi:clocks/wall-clock@0.2.0 (and 2 more WASI interfaces), but"),
        # beside the contract's own imports it is refused all the same
        ([_instance("aici:controller/host@0.1.0", "log", "u32"),
          _instance("wasi:filesystem/types@0.2.0", "filesystem-error-code", "u32")],
         "imports wasi:filesystem/types@0.2.0, but"),
        ([_instance("evil:os/files@1.0.0", "read")],
         "imports evil:os/files@1.0.0, which this host does not provide; this host provides "
         "only aici:controller/host@0.1.0, "),
        (['(import "getenv" (func (result string)))'],
         "imports getenv, which this host does not provide"),
        # an extra function smuggled into a contract interface
        ([_instance("aici:controller/host@0.1.0", "read-file", "string")],
         "imports aici:controller/host@0.1.0#read-file, which this host does not provide"),
    ],
)
def test_host_access_imports_are_refused_at_load(
    tmp_path: Path, imports: list[str], message: str
) -> None:
    path = tmp_path / "hostile.wat"
    path.write_text(_component_importing(*imports))
    with pytest.raises(ComponentError) as info:
        ControllerComponent.load(path, cache_dir=tmp_path)
    assert message in str(info.value)
    assert str(info.value).startswith(f"{path} imports ")


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


def test_hostile_lines_end_alone_and_the_rest_is_unchanged(tiny_model_dir: Path) -> None:
    normal = [_line(i, arg, f"a normal line {i}") for i, arg in NORMAL.items()]
    hostile = [_line(arg, arg, f"hostile {arg}") for arg in HOSTILE]
    mixed = [x for pair in zip(hostile, normal + [None] * len(hostile)) for x in pair if x]
    # None of these modes needs the deadline to be caught: a generous one keeps a slow,
    # busy machine from turning a heavy but legal call (1 MiB of logs) into a timeout.
    slack = ("--controller-timeout-ms", "2000")
    code, results, sizes = run_batch(tiny_model_dir, WAT, mixed, "--max-tokens", "16", *slack)
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

    code, alone, _ = run_batch(tiny_model_dir, WAT, normal, "--max-tokens", "16", *slack)
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
from aici_cli.cli import main
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


def test_memory_stays_bounded_over_many_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Eight rows that each log 1 MiB on every one of 60 steps (480 MiB if kept) beside
    # rows that pile up outputs and errors, after a run of as many quiet rows.
    quiet = [{"prompt": f"p{i}", "controller_arg": "A"} for i in range(8)]
    hostile = [{"prompt": f"p{i}", "controller_arg": "M"} for i in range(8)]
    hostile += [{"prompt": f"q{i}", "controller_arg": arg} for i, arg in enumerate("UVXUVX")]
    before, after = _peak_rss_mib(tiny_model_dir, tmp_path, [quiet, hostile],
                                  "--max-tokens", "60", "--controller", str(WAT))
    assert after - before < 100, f"peak RSS grew by {after - before:.0f} MiB"


# --- a real Python guest probing the sandbox --------------------------------------------


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from aici_cli.control.build import build_controller

    # A variable set while building must not reach the component either: componentize-py
    # snapshots the interpreter, environment included, at build time.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AICI_PROBE_MARKER", "leaked-from-the-build")
        out = tmp_path_factory.mktemp("probe") / "sandbox_probe.wasm"
        return build_controller(PROBE, out).out


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


# --- the host's vocabulary scans ---------------------------------------------------------


class _LLTok:
    """The two llguidance tokenizer calls a scan uses, over a list of token texts."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return "".join(self.texts[t] for t in tokens).encode()

    def is_special_token(self, token: int) -> bool:
        return False


def test_a_backtracking_pattern_cannot_stall_the_host() -> None:
    import time

    from aici_cli.control.wasm import TokenizerServices

    texts = ["a" * 40 + "!", "b", "ab"]  # `re` would take hours on the first one
    services = TokenizerServices(None, len(texts), 0, _LLTok(texts), scan_seconds=0.3)
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"took more than 0.3 s to match against the vocab"):
        services.tokens_matching("(a|a)+")
    assert time.perf_counter() - t0 < 5
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="took more than"):  # remembered, not rescanned
        services.tokens_matching("(a|a)+")
    assert time.perf_counter() - t0 < 0.1
    with pytest.raises(ValueError, match=r"bad pattern '\(': missing \), unterminated"):
        services.tokens_matching("(")
    handle = services.tokens_matching("[ab]+")
    assert services.host_set(handle).tolist() == [0b110]


def test_the_runs_pattern_cache_is_capped() -> None:
    from aici_cli.control.wasm import TokenizerServices

    texts = [chr(97 + i) for i in range(26)]  # a set costs its one 32-bit word plus its pattern
    services = TokenizerServices(None, len(texts), 0, _LLTok(texts), cache_bytes=15)
    assert services.tokens_matching("a") == 0
    assert services.tokens_matching("bb") == 1
    assert services.tokens_matching("a") == 0  # cached ones still answer
    with pytest.raises(ValueError, match=r"tokens-matching cache is full \(2 patterns"):
        services.tokens_matching("ccc")
