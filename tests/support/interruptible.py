"""Children a test interrupts with SIGINT, as a user's Ctrl-C would.

A child inherits an ignored SIGINT: a test run started as a shell's background job (a CI
script's `cmd &`, a job runner) has SIGINT ignored, its children too, and a run that finds
SIGINT ignored rightly keeps ignoring it (`run/interrupts.py`). Then every Ctrl-C test
would see a run that never hears the signal and finishes every line. `popen` starts the
child with SIGINT at its default, whatever this process has.
"""

from __future__ import annotations

import signal
import subprocess
from typing import Any


def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(args, **kwargs)`, the child hearing SIGINT."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)
