"""Broken controllers in one batch: each fault ends only its own sequence.

Uses the hand-written WAT component (tests/wat/controller.wat), whose `controller_arg`
picks a behaviour, through `aici-batch run` on the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from aici_cli.cli import main

WAT = Path(__file__).resolve().parent / "wat" / "controller.wat"

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


def run(lines: list[dict[str, Any]], model_dir: Path, *extra: str) -> tuple[int, list[dict]]:
    stdin = "".join(json.dumps(line) + "\n" for line in lines)
    res = CliRunner().invoke(main, [
        "run", "-", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
        "--controller", str(WAT), "--batch-size", "4", "-q", *extra,
    ], input=stdin)
    return res.exit_code, [json.loads(line) for line in res.stdout.splitlines()]


def test_each_fault_ends_only_its_sequence(tiny_model_dir: Path) -> None:
    lines = [{"id": arg, "prompt": f"line {arg}", "controller_arg": arg} for arg in CASES]
    code, results = run(lines, tiny_model_dir, "--max-tokens", "8")
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


def test_allow_list_is_enforced(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = set(tok.decode([5]) + tok.decode([7]))
    code, results = run([{"prompt": "x", "controller_arg": "a"}], tiny_model_dir,
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


def test_summary_reports_guest_call_times(tiny_model_dir: Path, tmp_path: Path) -> None:
    import jsonschema

    from aici_cli.jobs import load_schema

    stats = tmp_path / "stats.json"
    code, results = run([{"prompt": "x", "controller_arg": "A"}] * 3, tiny_model_dir,
                        "--max-tokens", "5", "--stats-out", str(stats))
    assert code == 0
    summary = json.loads(stats.read_text())
    jsonschema.validate(summary, load_schema("stats"))
    # One call at the start and one per sampled token but the last (it hit max_tokens).
    assert summary["guest_call_ms"]["calls"] == 3 * 5
    assert 0 < summary["guest_call_ms"]["p50"] <= summary["guest_call_ms"]["p99"]
    assert all(r["stats"]["guest_ms"] > 0 for r in results)
