"""The JavaScript guest SDK's unit tests (controllers/js/test, node's test runner).

They run the SDK, the four examples and the component glue in plain node against the stub
host, in well under a second; `test_js_controllers.py` runs the same code in components.
"""

from __future__ import annotations

import re
import subprocess

import pytest
from paths import CONTROLLERS

JS = CONTROLLERS / "js"


@pytest.mark.subprocess
def test_the_javascript_sdk_unit_tests_pass(node: str) -> None:
    proc = subprocess.run(
        [node, "--test", "--test-reporter=tap", "test/"],
        cwd=JS, capture_output=True, text=True, timeout=300,
    )
    report = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, report
    counts = {k: int(v) for k, v in re.findall(r"^# (pass|fail|skipped) (\d+)$", proc.stdout, re.M)}
    assert counts["fail"] == 0 and counts["skipped"] == 0, report
    assert counts["pass"] >= 31, report  # every test file was found and ran
