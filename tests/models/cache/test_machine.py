"""The CPU a cache folder was made on (models/cache/machine.py): recorded by the first
load, kept on this machine, and a folder another CPU made loses its machine-bound parts
(its compiled steps, kernels and verdicts), never its conversions."""

from __future__ import annotations

import json
from pathlib import Path

from aici_cli.models.cache import machine
from aici_cli.models.kernels.cpu_features import cpu_features


def _fill(root: Path) -> None:
    for name in (*machine.MACHINE_BOUND, "models"):
        (root / name).mkdir(parents=True)
        (root / name / "entry").write_text(name)


def test_a_new_cache_records_this_cpu_and_keeps_everything(tmp_path: Path) -> None:
    _fill(tmp_path)
    assert machine.check_machine(tmp_path) is None
    record = json.loads((tmp_path / machine.MACHINE_FILE).read_text())
    assert record == {"fingerprint": cpu_features().fingerprint}
    assert machine.check_machine(tmp_path) is None  # this machine's: nothing happens
    assert all((tmp_path / name / "entry").is_file()
               for name in (*machine.MACHINE_BOUND, "models"))


def test_a_cache_another_cpu_made_loses_its_machine_bound_parts(tmp_path: Path) -> None:
    _fill(tmp_path)
    other = "Linux x86_64 Some Other CPU 0123456789ab"
    (tmp_path / machine.MACHINE_FILE).write_text(json.dumps({"fingerprint": other}))
    note = machine.check_machine(tmp_path)
    assert note is not None and other in note and "compiled-steps" in note
    assert not any((tmp_path / name).exists() for name in machine.MACHINE_BOUND)
    assert (tmp_path / "models" / "entry").read_text() == "models"  # the conversions stay
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert json.loads((tmp_path / machine.MACHINE_FILE).read_text())["fingerprint"] \
        == cpu_features().fingerprint
    assert machine.check_machine(tmp_path) is None  # recorded: now this machine's
