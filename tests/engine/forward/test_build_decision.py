"""`auto`'s forecast of whether building the compiled step beside a run pays within it
(engine/forward/build_decision.py), and the build times it keeps per machine."""

from __future__ import annotations

import json
from pathlib import Path

from aici_cli.engine.forward import build_decision
from aici_cli.engine.forward.build_decision import BUILD_S, forecast


def test_a_run_shorter_than_the_build_never_builds_beside_it() -> None:
    # The 64-line eval at batch 8: 2,048 steps of budget, ~17 ms eager passes: ~21 s of
    # expected eager time, against a build ready after ~90 s beside the run.
    f = forecast(steps_ahead=64 * 256 // 8, eager_pass_s=0.017)
    assert not f.pays
    assert f.ahead_s < f.ready_s and f.saved_s == 0.0
    assert not forecast(0, 0.017).pays  # nothing ahead


def test_a_long_run_builds_at_once_and_the_margin_decides_in_between() -> None:
    long = forecast(steps_ahead=200_000, eager_pass_s=0.017)  # ~34 min of eager passes
    assert long.pays and long.saved_s > 100 * long.lost_s
    ready = BUILD_S / build_decision.BESIDE_SHARE
    # Just past `ready`, the few compiled steps do not win back the slowed ones...
    steps = int(1.05 * ready / (build_decision.EXPECTED_USE * 0.017))
    assert not forecast(steps, 0.017).pays
    # ...twice past it they do; and a slower build (measured here) turns it down again.
    steps = int(2 * ready / (build_decision.EXPECTED_USE * 0.017))
    assert forecast(steps, 0.017).pays
    assert not forecast(steps, 0.017, build_s=3 * BUILD_S).pays
    # A compiled step no faster than eager never pays.
    assert not forecast(200_000, 0.017, ratio=1.0).pays


def test_build_times_are_kept_per_machine_and_the_slowest_is_used(tmp_path: Path) -> None:
    assert build_decision.recorded_build_s(tmp_path, "machine a") == BUILD_S  # none yet
    for seconds in (30.0, 95.8, 27.5):
        build_decision.record_build_s(tmp_path, "machine a", seconds)
    build_decision.record_build_s(tmp_path, "machine b", 10.0)
    assert build_decision.recorded_build_s(tmp_path, "machine a") == 95.8
    assert build_decision.recorded_build_s(tmp_path, "machine b") == 10.0
    for _ in range(10):
        build_decision.record_build_s(tmp_path, "machine b", 12.0)
    kept = json.loads((tmp_path / build_decision.TIMES_FILE).read_text())
    assert kept["machine b"] == [12.0] * 8  # the last 8
    (tmp_path / build_decision.TIMES_FILE).write_text("not json")
    assert build_decision.recorded_build_s(tmp_path, "machine a") == BUILD_S
