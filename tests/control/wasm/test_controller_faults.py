"""Broken controllers in one batch: each fault ends only its own sequence.

One component of small hand-written WAT guests (tests/support/wat.py), the first character
of a line's `controller_arg` picking the guest, run through `aici-batch run` on the tiny
model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from wat import OOM_HOOK, Guest, component, save, u32s

from aici_cli.cli.main import main

GUESTS = {
    "A": Guest("(call $sample-all)"),
    "t": Guest(  # traps on its 5th call
        "(if (i32.ge_u (global.get $calls) (i32.const 5)) (then unreachable)) (call $sample-all)"
    ),
    "w": Guest("(loop $forever (br $forever)) unreachable"),
    "g": Guest(  # grows memory without bound, then aborts the way Rust's allocator does
        """
        (loop $more (br_if $more (i32.ne (memory.grow (i32.const 1)) (i32.const -1))))
        (call $handle_alloc_error)
        unreachable
        """,
        funcs=(OOM_HOOK,),
    ),
    "k": Guest("(call $sample-bitmask {mask})", data={"mask": u32s(0xFFFFFFFF)}),
    "H": Guest("(call $sample-host-set (i32.const 77))"),
    "e": Guest("(call $sample-allow (i32.const 0) (i32.const 0))"),
    "x": Guest("(call $err {nope})", data={"nope": "nope"}),
    "c": Guest("(call $stop)", constructor="unreachable"),
    "p": Guest("(call $splice (i32.const 1) {ff})", data={"ff": u32s(10, 11)}),
    "a": Guest("(call $sample-allow {allow})", data={"allow": u32s(5, 7)}),
}

# controller_arg -> expected error type (None: the line must succeed).
CASES: dict[str, str | None] = {
    "A": None,  # sample(all)
    "t": "controller_trap",  # traps on its 5th call
    "w": "controller_timeout",  # loops forever
    "g": "controller_memory",  # grows memory without bound
    "k": "bad_action",  # a bitmask with the wrong number of words
    "H": "bad_action",  # an unknown host-set handle
    "e": "bad_action",  # empty allow-list
    "x": "controller_error",  # returns err("nope")
    "c": "controller_trap",  # traps in the constructor
    "p": "bad_backtrack",  # backtracks past the prompt
    "a": None,  # sample(allow [5, 7])
}


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("wat"), component(GUESTS))


def run(lines: list[dict[str, Any]], model_dir: Path, controller: Path,
        *extra: str) -> tuple[int, list[dict]]:
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    res = CliRunner().invoke(main, [
        "run", "-", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
        "--controller", str(controller), "--batch-size", "4", "-q", *extra,
    ], input=stdin)
    return res.exit_code, [json.loads(line) for line in res.stdout.splitlines()]


def test_each_fault_ends_only_its_sequence(tiny_model_dir: Path, controller: Path) -> None:
    lines = [{"id": arg, "prompt": f"line {arg}", "controller_arg": arg} for arg in CASES]
    code, results = run(lines, tiny_model_dir, controller, "--max-tokens", "8")
    assert code == 1
    by_id = {r["id"]: r for r in results}
    assert sorted(by_id) == sorted(CASES)
    for arg, etype in CASES.items():
        r = by_id[arg]
        if etype is None:
            assert r["finish_reason"] == "length", r
            assert r["stats"]["output_tokens"] == 8
        else:
            assert r["finish_reason"] == "error", r
            assert r["error"]["type"] == etype, r["error"]
            assert r["error"]["message"].startswith(f"line {r['index']}: ")
    assert "nope" in by_id["x"]["error"]["message"]
    # The trap came on the 5th call: four tokens were sampled before it.
    assert by_id["t"]["stats"]["output_tokens"] == 4


def test_allow_list_is_enforced(tiny_model_dir: Path, controller: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = set(tok.decode([5]) + tok.decode([7]))
    code, results = run([{"prompt": "x", "controller_arg": "a"}], tiny_model_dir, controller,
                        "--max-tokens", "6")
    assert code == 0
    assert results[0]["stats"]["output_tokens"] == 6
    assert set(results[0]["text"]) <= allowed


def test_not_a_component_is_a_usage_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "x.wasm"
    bogus.write_bytes(b"\0asm\x01\0\0\0")  # a core module header, not a component
    res = CliRunner().invoke(main, ["run", "-", "--model", str(tiny_model_dir),
                                    "--controller", str(bogus)], input="")
    assert res.exit_code == 2
    assert "not a WebAssembly component" in res.stderr


def test_summary_reports_guest_call_times(tiny_model_dir: Path, tmp_path: Path,
                                          controller: Path) -> None:
    import jsonschema

    from aici_cli.formats.jobs import load_schema

    stats = tmp_path / "stats.json"
    code, results = run([{"prompt": "x", "controller_arg": "A"}] * 3, tiny_model_dir,
                        controller, "--max-tokens", "5", "--stats-out", str(stats))
    assert code == 0
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, load_schema("stats"))
    # One call at the start and one per sampled token but the last (it hit max_tokens).
    assert summary["guest_call_ms"]["calls"] == 3 * 5
    assert 0 < summary["guest_call_ms"]["p50"] <= summary["guest_call_ms"]["p99"]
    assert all(r["stats"]["guest_ms"] > 0 for r in results)
