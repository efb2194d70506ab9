"""Admission's per-line work: a line read ahead becomes a tokenized `Prepared`, an
admitted one gets its controllers (or its scored choices' token sequences). A line that
fails here becomes its own error result; the run goes on.

A scored line's choices (scoring.py): the prompt and each choice are tokenized together,
and the choice's tokens are those past the longest common prefix with the prompt's own
tokens. A token that merges the end of the prompt with the start of the choice
(" Paris" after "is") thus counts to the choice, scored given the prompt tokens before
it, which is what the model sees when it writes the choice itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from aici_cli.control.base import Controller
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.grammar.closing import Closer
from aici_cli.control.grammar.early_close import Closing
from aici_cli.core.config import EngineConfig
from aici_cli.core.errors import ControllerError, GrammarError, ModelError
from aici_cli.core.job import BadLine, Job, error_result
from aici_cli.engine.rows import Prepared, common_prefix
from aici_cli.models.load import LoadedModel
from aici_cli.models.tokenizer.chat import render_prompt

ControllerFactory = Callable[[Job], "Controller | None"]
Emit = Callable[[dict[str, Any]], None]
T = TypeVar("T")


def token_ids_problem(job: Job, vocab_size: int) -> str | None:
    """What is wrong with the token ids a line names (`logit_bias`, `stop_token_ids`) for
    this model, or None: each must be below the vocabulary size (as vLLM checks)."""
    for field, ids in (("logit_bias", [t for t, _ in job.sampling.logit_bias]),
                       ("stop_token_ids", sorted(job.stop_token_ids))):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            return (f"field '{field}' has token id(s) {outside[:5]} outside the model's "
                    f"vocabulary (ids 0 to {vocab_size - 1})")
    return None


def choice_sequences(tokenizer: Any, text: str, special: bool, context: Sequence[int],
                     options: Sequence[str]) -> list[tuple[list[int], int]]:
    """For each option: the ids of `text + option` tokenized together, and where the
    option's tokens start in them (at least 1: something must predict the first)."""
    ctx = np.asarray(context, dtype=np.int64)
    out = []
    for option in options:
        ids = list(tokenizer(text + option, add_special_tokens=special)["input_ids"])
        start = common_prefix(np.asarray(ids, dtype=np.int64), ctx)
        if start == 0:
            raise GrammarError("invalid_choices",
                               f"choice {option!r} merges with the whole prompt's first token; "
                               "it cannot be scored after it")
        out.append((ids, start))
    return out


# The constraint kinds whose lines are closed at the limit and guarded against loops.
CLOSABLE = ("json_schema", "regex", "lark", "tool_calls")


class LineIntake:
    def __init__(self, lm: LoadedModel, config: EngineConfig, max_positions: int,
                 controller_factory: ControllerFactory | None = None) -> None:
        self.lm = lm
        self.config = config
        self.max_positions = max_positions
        self.controller_factory = controller_factory
        self._compiler: GrammarCompiler | None = None
        self._closer: Closer | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.lm.tokenizer, self.lm.vocab_size,
                                             sorted(self.lm.eos_token_ids),
                                             self.config.strict_json)
        return self._compiler

    @property
    def compile_ms(self) -> list[float]:
        """Compile time of each distinct grammar of the run (empty when none compiled)."""
        return self._compiler.compile_ms if self._compiler is not None else []

    def prepare(self, item: Job | BadLine, emit: Emit) -> Prepared | None:
        """A line read ahead, tokenized. A line error, or a prompt that cannot be
        tokenized, becomes that line's error result (and None)."""
        if isinstance(item, BadLine):
            emit(error_result(item))
            return None
        outside = token_ids_problem(item, self.lm.vocab_size)
        if outside is not None:
            emit(error_result(BadLine(item.index, item.id, "invalid_line",
                                        f"line {item.index}: {outside}")))
            return None
        return self.guard(item, emit, lambda: Prepared.of(item, self.tokenize(item)))

    def controllers(self, job: Job, emit: Emit) -> list[Controller | None] | None:
        """The controller of each of the job's `n` samples; None after emitting the
        line's error when one cannot be built."""
        return self.guard(job, emit, lambda: [self.controller(job) for _ in range(job.n)])

    def choice_sequences(self, line: Prepared, emit: Emit) -> list[tuple[list[int], int]] | None:
        """A scored line's choices tokenized with its prompt (see `scoring.py`)."""
        job = line.job
        assert job.constraint is not None and job.constraint.kind == "choice"
        options = list(job.constraint.value)
        text, special = self.prompt_text(job)
        return self.guard(job, emit, lambda: choice_sequences(
            self.lm.tokenizer, text, special, line.prompt, options))

    @staticmethod
    def guard(job: Job, emit: Emit, build: Callable[[], T]) -> T | None:
        """`build()`, or None after emitting its failure as the line's error result (a
        bug, too, costs this line only, not the run)."""
        try:
            return build()
        except (GrammarError, ControllerError, ModelError) as e:
            emit(error_result(BadLine(job.index, job.id, e.type, f"line {job.index}: {e}")))
        except Exception as e:
            emit(error_result(BadLine(job.index, job.id, "internal_error",
                                        f"line {job.index}: {type(e).__name__}: {e}")))
        return None

    def prompt_text(self, job: Job) -> tuple[str, bool]:
        """The prompt as text, and whether tokenizing it adds the special tokens (a raw
        prompt gets them; a rendered chat template has its own)."""
        if job.messages is not None:
            return render_prompt(self.lm.tokenizer, job.messages, job.tools), False
        assert job.prompt is not None
        return job.prompt, True

    def tokenize(self, job: Job) -> list[int]:
        text, special = self.prompt_text(job)
        ids = self.lm.tokenizer(text, add_special_tokens=special)["input_ids"]
        if not ids:
            raise ModelError("prompt encodes to no tokens")
        limit = self.max_positions - job.max_tokens
        if len(ids) > limit:
            raise GrammarError(
                "prompt_too_long",
                f"prompt has {len(ids)} tokens; with max_tokens {job.max_tokens} the model's "
                f"{self.max_positions} positions allow at most {max(limit, 0)}",
            )
        return list(ids)

    def controller(self, job: Job) -> Controller | None:
        if self.controller_factory is not None:
            custom = self.controller_factory(job)
            if custom is not None:
                return custom
        if job.constraint is None:
            return None
        relax = job.schema_fallback == "relax"
        return GrammarController(self.compiler.compile(job.constraint, relax),
                                 self.config.fast_forward, self._closing(job))

    def _closing(self, job: Job) -> Closing | None:
        """When a constrained line (JSON schema, regex, Lark grammar, tool calls) may be
        finished early (`--close-at-limit`, `--loop-guard`, both on by default). A choice
        is a few tokens from the start: nothing to close."""
        cfg = self.config
        if not (cfg.close_at_limit or cfg.loop_guard) or job.constraint is None or (
                job.constraint.kind not in CLOSABLE):
            return None
        if self._closer is None:
            self._closer = Closer(self.lm.tokenizer, self.compiler.tokenizer.decode_bytes)
        return Closing(self._closer, job.max_tokens, cfg.close_at_limit, cfg.loop_guard)
