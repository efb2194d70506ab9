"""`FatalError`, the CLI's one-line exit: a leaf that `cli/main.py` and the command modules
beside it (`cli/registry.py`) share, so that neither imports the other back."""

from __future__ import annotations

import click


class FatalError(click.ClickException):
    """A problem that stops the whole run: one line on stderr, exit code 2."""

    exit_code = 2
