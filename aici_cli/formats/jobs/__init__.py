"""Input lines in: JSONL lines become `Job`s to run or `BadLine`s to report (both
declared in `aici_cli.core.job`).

    parse     read_jobs, open_input: one line through every check into a Job
    checks    the checks before schema validation: size, UTF-8, JSON, depth, Unicode,
              constraint size
    messages  the one-line problem text of a BadLine

Whether a `json_schema` is usable is `aici_cli.control.schema_check`; the tool's own
schemas are `aici_cli.formats.schemas`; result lines out are written by
`aici_cli.run.result_writer`. Torch-free: the CLI imports it at startup.
"""

from aici_cli.core.job import BadLine, Job, TranslateError
from aici_cli.formats.jobs.parse import Translate, open_input, read_jobs
from aici_cli.formats.schemas import load_schema

__all__ = ["Job", "BadLine", "Translate", "TranslateError", "load_schema", "open_input",
           "read_jobs"]
