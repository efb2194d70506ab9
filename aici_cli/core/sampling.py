"""The per-line sampling options, declared once: `Sampling` holds the values a line samples
with, and each of its fields carries its `Option` (default, valid range, the `run` option's
help, the name an OpenAI or vLLM request gives it).

Sampling here means what decides each token once the model has given its logits: the
logit rules (penalties, `logit_bias`, `min_tokens`' hold of end-of-sequence) and the
sampler's settings (temperature, the filters, the seed). What ends a line (`max_tokens`,
`stop`, `stop_token_ids`, `ignore_eos`) and what shapes it (`n`, a constraint, logprobs)
stay `Job`'s own fields.

Everything else is derived from these declarations: the `run` options that set a run's
defaults (cli/run_options.py) and `JobDefaults.sampling`, a line's fields read into a `Job`
(`line_sampling`), the up-front check of the run's defaults (formats/jobs/defaults.py),
the OpenAI batch mapping (formats/openai_batch.py), `made_with` (run/made_with.py) and
lm-eval's gen_kwargs (evals/requests.py). The input-line schema
(schemas/input-line.schema.json, a published file) holds each range as `Option.schema`
gives it, which tests/core/test_sampling_definition.py checks. Adding an option is a field
here, its use in the sampler (engine/logits/sampler.py), its entry in that schema (with
a description for its readers) and a test.

Torch-free, like the rest of core.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# Where each field's `Option` sits in its dataclass field's metadata.
_KEY = "option"


@dataclass(frozen=True)
class Range:
    """A number's valid range: from `low` (excluded where `low_open`) to `high`, both part
    of the `run` option's type (its --help shows them). `cap` is an upper bound against
    absurd values only (a seed past 63 bits, a temperature of 50): a line's value is
    checked against it, and the option's too, as the line of the run's defaults is
    (jobs/defaults.py), but --help does not show it as the option's range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.high is not None and self.cap is not None:
            raise ValueError("a range has a `high` or a `cap`, not both")


@dataclass(frozen=True)
class Option:
    """One sampling option, as every part of the tool that reads or writes it knows it."""

    default: Any
    # None: checked by the input-line schema alone (`logit_bias`: an object of token ids).
    range: Range | None
    help: str | None  # the `run` option's help text
    # False for an option about token ids, which depend on the model (`logit_bias`): a line
    # sets it, a run has no option for it.
    run_option: bool
    read: Callable[[Any], Any]  # a line's JSON value (checked by the schema) -> the field's
    name: str = ""  # the field's, filled in by `OPTIONS`
    request: str = ""  # its name in an OpenAI or vLLM request body ("": the field's own)

    @property
    def flag(self) -> str:
        """The `run` option: `--min-p` for `min_p`."""
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> type:
        """int or float: the type of its value, from its default's."""
        return type(self.default)

    def schema(self) -> dict[str, Any]:
        """The input-line schema's checks of this option's value: its type and range."""
        assert self.range is not None, f"{self.name} is checked by the schema's own rule"
        checks: dict[str, Any] = {"type": "integer" if self.kind is int else "number"}
        low, high = self.range.low, self.range.high
        if high is None:
            high = self.range.cap
        if low is not None:
            checks["exclusiveMinimum" if self.range.low_open else "minimum"] = low
        if high is not None:
            checks["maximum"] = high
        return checks


def _option(default: Any, range_: Range | None, help: str | None = None, *,
            run_option: bool = True, read: Callable[[Any], Any] | None = None,
            request: str = "") -> Any:
    """A `Sampling` field with its `Option` (`read`: the default's type, e.g. float)."""
    option = Option(default, range_, help, run_option, read or type(default), request=request)
    return field(default=default, metadata={_KEY: option})


def _off_below_zero(value: Any) -> int:
    """top_k: -1 is off, as 0 is (vLLM's spelling of off)."""
    return max(0, int(value))


def _token_biases(value: Any) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs, ids ascending, from a line's {"id": bias} (or pairs); "7" and
    "007" are one id (the last wins, as in vLLM)."""
    return tuple(sorted({int(t): float(b) for t, b in dict(value).items()}.items()))


@dataclass(frozen=True)
class Sampling:
    """How a line's tokens are chosen, vLLM's semantics; the defaults leave the logits
    untouched and decode greedily. Fields in the order `run --help` lists their options
    (penalties and the rest in the order they apply)."""

    temperature: float = _option(0.0, Range(0.0, cap=10.0), "0 is greedy.")
    top_p: float = _option(1.0, Range(0.0, 1.0, low_open=True))
    seed: int = _option(0, Range(0, cap=2**63 - 1), "Default per-line sampling seed.")
    # The filters apply to a line with a temperature (greedy lines ignore them).
    top_k: int = _option(
        0, Range(-1), "With a temperature, sample among the K most likely tokens; 0 or -1: off.",
        read=_off_below_zero)
    min_p: float = _option(
        0.0, Range(0.0, 1.0), "With a temperature, drop tokens less likely than P times the "
        "most likely one; 0: off.")
    typical_p: float = _option(
        1.0, Range(0.0, 1.0, low_open=True), "With a temperature, sample among the tokens "
        "whose surprisal is nearest the entropy, the fewest that hold P of the mass (locally "
        "typical sampling); 1: off.")
    # Logit rules, applied before a constraint's mask (engine/logits/logit_rules.py).
    frequency_penalty: float = _option(
        0.0, Range(-2.0, 2.0), "Subtracted from a token's logit per time it occurs in the output.")
    presence_penalty: float = _option(
        0.0, Range(-2.0, 2.0), "Subtracted from the logit of every token the output holds.")
    repetition_penalty: float = _option(
        1.0, Range(0.0, low_open=True), "Divides positive logits and multiplies negative ones "
        "of the tokens in the prompt or output; 1: off.")
    # End-of-sequence and stop_token_ids are held back until then (and no stop string ends
    # within them: engine/stops.py); at most the line's max_tokens (jobs/parse.py).
    min_tokens: int = _option(
        0, Range(0, cap=1_000_000), "Tokens generated before end-of-sequence, a stop token "
        "id or a stop string may end a line.")
    logit_bias: tuple[tuple[int, float], ...] = _option(
        (), None, run_option=False, read=_token_biases)  # (token id, bias), ids ascending

    @property
    def adjusts_logits(self) -> bool:
        """Whether a rule of `engine/logits/logit_rules.py` changes this line's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0 or self.min_tokens)

    def run_values(self) -> dict[str, Any]:
        """The options a `run` option sets, by field name, in --help order: the line the
        run's defaults are checked as, and `made_with`'s record."""
        return {option.name: getattr(self, option.name) for option in RUN_OPTIONS}


# Every option, by field name, in `Sampling`'s order.
OPTIONS: dict[str, Option] = {
    f.name: dataclasses.replace(f.metadata[_KEY], name=f.name,
                                request=f.metadata[_KEY].request or f.name)
    for f in fields(Sampling)
}
# The options a run sets a default of (`--temperature`, ...), in --help order.
RUN_OPTIONS: tuple[Option, ...] = tuple(o for o in OPTIONS.values() if o.run_option)


def line_sampling(line: Mapping[str, Any], defaults: Sampling) -> Sampling:
    """A checked line's sampling: each option the line's own value, else the run's."""
    return Sampling(**{name: option.read(line[name] if name in line else getattr(defaults, name))
                       for name, option in OPTIONS.items()})
