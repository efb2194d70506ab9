"""The one way the tests make a `Job`: `job` with the defaults every engine test shares, and
`job_factory` for a test file's own defaults and positional arguments."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from aici_cli.core.job import Job
from aici_cli.core.sampling import OPTIONS, Sampling


def job(index: int, prompt: str | None = None, **fields: Any) -> Job:
    """A line as the engine tests write it: id `j<index>`, no messages, greedy (temperature
    0, top_p 1), seeded by its index, at most 16 tokens. Any of these, or any other `Job`
    field, as a keyword; a sampling option (`temperature`, `min_p`, ...: core/sampling.py)
    too, as a keyword of its own, or all of them as `sampling`."""
    options = {name: fields.pop(name) for name in list(fields) if name in OPTIONS}
    sampling = fields.pop("sampling", Sampling(seed=index))
    values: dict[str, Any] = dict(
        index=index, id=f"j{index}", prompt=prompt, messages=None, max_tokens=16,
        sampling=dataclasses.replace(sampling, **options),
    )
    values.update(fields)
    return Job(**values)


def job_factory(shape: Callable[..., Mapping[str, Any]] | None = None,
                **defaults: Any) -> Callable[..., Job]:
    """`job` with a test file's defaults. The factory it returns is called as
    `factory(index, *args, **fields)`: `shape(index, *args)` gives the fields its positional
    arguments set (without `shape`, the one positional argument is the prompt); a keyword
    of the call wins over both, and both over `defaults`.

    `job_factory(max_tokens=6)(1, "text", seed=9)`;
    `job_factory(lambda index, options: {"constraint": Constraint("choice", options)})`."""

    def make(index: int, *args: Any, **fields: Any) -> Job:
        if shape is not None:
            shaped = dict(shape(index, *args))
        else:
            if len(args) > 1:
                raise TypeError(f"one positional argument (the prompt) after the index, "
                                f"not {len(args)}")
            shaped = {"prompt": args[0]} if args else {}
        return job(index, **{**defaults, **shaped, **fields})

    return make
