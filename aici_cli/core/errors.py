"""The errors the library raises, in one torch-free module the CLI can import at once.

Two tiers, as in llguidance: a `LineFailure` is the state of one line or sequence (its
`type` becomes the result's `error.type`, the run goes on); `UsageError` and `ModelError`
stop the whole run with one line on stderr (exit code 2).
"""

from __future__ import annotations


def one_line(exc: BaseException, limit: int | None = None) -> str:
    """An exception as the one line a user reads: `TypeName: first line of the message`,
    or just `TypeName` when the message is empty, cut to `limit` characters.

    Library errors (transformers, huggingface_hub, jinja, numpy, torch.compile) often span
    many lines or say nothing at all; every fatal error and every recorded reason is one line.
    """
    text = str(exc).strip().splitlines()
    first = text[0].strip() if text else ""
    line = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return line if limit is None else line[:limit]


class UsageError(Exception):
    """A problem with how the CLI was invoked (e.g. unreadable input); the CLI prints it
    as one line and exits with a usage status instead of showing a traceback."""


class ReportError(Exception):
    """Bad input to `aici-batch report` (malformed line, unreadable file, missing
    matplotlib); the message is meant for the user as is."""


class ModelError(Exception):
    """A one-line, user-facing reason the model cannot be used (the CLI exits with 2).

    Raised while a line is admitted (its prompt cannot be tokenized), it is that line's
    error of type `type` instead.
    """

    type = "model_error"


class NoChatTemplateError(ModelError):
    """A `messages` line for a model without a chat template: that line's error only.

    The engine reports `type` as the line's error type; `prompt` lines still run.
    """

    type = "no_chat_template"


class LineFailure(Exception):
    """Something that ends one line or sequence; `type` is the result's error type."""

    def __init__(self, type: str, message: str) -> None:
        super().__init__(message)
        self.type = type
        self.message = message


class ControllerError(LineFailure):
    """A controller failed; it ends only its own sequence (finish_reason "error")."""


class GrammarError(LineFailure):
    """A constraint that cannot be compiled; `type` is the result line's error type."""


class ClusterError(Exception):
    """Ray workers cannot run the lines: none could start, or every one died for good
    (the CLI exits with 2). Results already written stay; `--resume` runs the rest."""
