"""The guest SDK's examples (controllers/examples) as modules, for the tests that run them
under the stub host (tests/sdk/test_sdk.py, tests/sdk/test_sdk_fork.py)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from paths import CONTROLLERS


def load_example(name: str) -> ModuleType:
    """Import controllers/examples/NAME.py under a private name (`profile` is stdlib)."""
    path = CONTROLLERS / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"aici_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
