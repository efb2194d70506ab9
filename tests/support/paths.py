"""Where the tests find the tree, whatever folder a test file sits in: one place that
knows the depth of tests/support/, so that moving a test never changes a path it reads.

- `ROOT`: the checkout; `TESTS`, `SUPPORT`: tests/ and this folder;
- `DATA`, `GUESTS`: tests/data (fixtures, WIT versions, lm-eval tasks) and tests/guests
  (guest sources the tests build);
- `CONTROLLERS`: the guest SDK and its examples;
- `JSONSCHEMABENCH`: the JSONSchemaBench schemas, kept beside the checkout (shared/data).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
SUPPORT = TESTS / "support"
DATA = TESTS / "data"
GUESTS = TESTS / "guests"
CONTROLLERS = ROOT / "controllers"
JSONSCHEMABENCH = ROOT.parent / "shared" / "data" / "jsonschemabench"
