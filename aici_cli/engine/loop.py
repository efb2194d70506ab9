"""The decode loop: rows refilled continuously, one batched forward pass per step.

A step, top to bottom (`Engine._step`):
  1. take the rows: new lines were admitted into idle rows (their first pass prefills the
     prompt plus any tokens their controller fast-forwards at the start);
  2. propose drafts for greedy rows (draft.py);
  3. start filling token masks in a worker thread: they depend only on tokens already
     known, so they overlap the forward pass (llguidance and torch release the GIL);
  4. one forward pass over the span of running rows, each feeding 1 sampled token,
     several fast-forward ones or, for a new line, its prompt: packed without padding
     (inputs.py, attention.py), so a long chunk costs its own tokens only;
  5. apply the masks in place, sample one token per row;
  6. hand each row's token (and its accepted draft) to its controller, which answers
     with fast-forward tokens, backtrack or stop;
  7. release finished rows: each emits its result and its row is free for the next line.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from aici_cli.config import EngineConfig
from aici_cli.control.base import Controller, Directive
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.control.stop_strings import find_stop
from aici_cli.engine.attention import install
from aici_cli.engine.cache import RowCache
from aici_cli.engine.clock import Now, StepClock, ms
from aici_cli.engine.draft import accept_draft, propose_drafts
from aici_cli.engine.generation import Finish, Generation, SampleGroup
from aici_cli.engine.masks import MaskVerdict, TokenMasks, apply_masks, controller_fault
from aici_cli.engine.passes import ModelPass
from aici_cli.engine.result_line import combine_samples, generation_result
from aici_cli.engine.rows import RowTable, Source
from aici_cli.engine.sampling import row_generator, sample
from aici_cli.errors import ControllerError, GrammarError, ModelError
from aici_cli.jobs import Job, LineError
from aici_cli.models.chat import render_prompt
from aici_cli.models.load import LoadedModel
from aici_cli.results import error_result
from aici_cli.stats import StepTimes

ControllerFactory = Callable[[Job], "Controller | None"]
Emit = Callable[[dict[str, Any]], None]


class Engine:
    """Runs jobs on one loaded model. `run` emits one result dict per job or line error.

    `now` is the clock of every timing (seconds); tests pass a fake one.
    """

    def __init__(self, lm: LoadedModel, config: EngineConfig,
                 controller_factory: ControllerFactory | None = None,
                 now: Now = time.perf_counter) -> None:
        self.lm = lm
        self.config = config
        self.now = now
        self.vocab_size = lm.vocab_size
        self.eos = lm.eos_token_ids
        model_cfg = lm.model.config
        self.max_positions = int(getattr(model_cfg, "max_position_embeddings", 1 << 15))
        install(lm.model)
        self._compiler: GrammarCompiler | None = None
        self.controller_factory = controller_factory
        self.cache = RowCache(
            num_layers=int(model_cfg.num_hidden_layers),
            rows=config.batch_size,
            capacity=min(config.initial_capacity, self.max_positions),
        )
        self.rows = RowTable(config.batch_size, self.cache)
        self.model_pass = ModelPass(lm, self.cache, self.rows)
        self.masks = TokenMasks(config.batch_size, self.vocab_size)
        self.step_times: list[StepTimes] = []

    @property
    def compiler(self) -> GrammarCompiler:
        if self._compiler is None:
            self._compiler = GrammarCompiler(
                self.lm.tokenizer, self.vocab_size, sorted(self.eos), self.config.strict_json
            )
        return self._compiler

    @property
    def compile_ms(self) -> list[float]:
        """Compile time of each distinct grammar of the run (empty when none compiled)."""
        return self._compiler.compile_ms if self._compiler is not None else []

    # ----------------------------------------------------------------------------- run

    @torch.inference_mode()
    def run(self, items: Iterable[Job | LineError], emit: Emit,
            should_admit: Callable[[], bool] = lambda: True) -> None:
        """Drive every item to exactly one `emit`ted result; returns when all are done."""
        source: Source | None = iter(items)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aici-mask")
        try:
            while True:
                # Samples of a line already started are admitted even after admission of
                # new lines stopped (an interrupt): the line must still get its result.
                pull = source is not None and should_admit()
                if pull or self.rows.waiting:
                    source = self.rows.admit(source, pull, lambda item: self._start(item, emit))
                if not self.rows.busy():
                    if not self.rows.waiting and (source is None or not should_admit()):
                        return
                    continue
                self._step(emit)
        finally:
            self.pool.shutdown(wait=True)

    # ---------------------------------------------------------------------------- step

    def _step(self, emit: Emit) -> None:
        clock = StepClock(self.now)
        rows, gens = self.rows.take_part()  # who feeds what in this pass
        kind = "prefill" if any(g is not None and g.length == 0 for g in gens) else "decode"
        # Before the mask worker starts: drafts and masks both read the matchers.
        drafts = propose_drafts(gens, self.config.draft_tokens, self.eos)
        fed = sum(len(g.pending) for g in gens if g is not None)
        fed += sum(len(d) - 1 for d in drafts if d)
        masks = self.pool.submit(self.masks.fill, rows, gens)  # overlaps the forward pass
        clock.mark("forward")
        out = self.model_pass.run(rows[0], gens, drafts)
        clock.mark("forwarded")
        verdict = self._verdict(masks.result(), out.out_of_memory)
        clock.mark("masks_ready")
        logits = out.next_token_logits(len(gens))
        greedy = apply_masks(logits, verdict)  # the failed rows now include empty masks
        clock.mark("masked")
        self._release(rows, gens, self._fail(gens, verdict.failed), emit)
        real = [k for k, g in enumerate(gens) if g is not None and k not in verdict.deferred]
        picked = self._sample(logits, greedy.tolist(), real, gens)
        clock.mark("sampled")
        times = clock.times(kind, rows=len(real), tokens=fed)
        controller_ms = self._hand_over(gens, real, picked, drafts, out.draft_picks(len(gens)),
                                        out.extra_at, verdict.deferred, times)
        self.step_times.append(clock.finish(times, controller_ms))
        self._release(rows, gens, [*real, *verdict.deferred], emit)  # finished rows

    @staticmethod
    def _verdict(verdict: MaskVerdict, out_of_memory: list[int]) -> MaskVerdict:
        """A row that ran out of memory even alone has no logits: it fails, whatever its
        controller answered."""
        for k in out_of_memory:
            verdict.deferred.pop(k, None)
            verdict.failed[k] = ControllerError(
                "out_of_memory", "out of memory even with this sequence alone in the pass")
        return verdict

    @staticmethod
    def _sample(logits: torch.Tensor, greedy: list[int], real: list[int],
                gens: list[Generation | None]) -> list[int]:
        """One token for each row in `real` (greedy, or seeded temperature / top-p)."""
        chosen = [g for g in (gens[k] for k in real) if g is not None]
        return sample(logits, greedy, real, [g.job.temperature for g in chosen],
                      [g.job.top_p for g in chosen], [g.generator for g in chosen])

    def _hand_over(self, gens: list[Generation | None], real: list[int], picked: list[int],
                   drafts: list[list[int]], predicted: list[int], extra_at: list[int],
                   deferred: dict[int, Directive], times: StepTimes) -> float:
        """Give each row its sampled token and the draft tokens the model confirmed, and
        the rows whose controller answered with a directive that directive; returns the
        controllers' ms."""
        b = len(gens)
        controller_ms = 0.0
        for k, token in zip(real, picked):
            gen = gens[k]
            assert gen is not None
            controller_ms += self._commit(gen, token, times)
            if drafts[k]:
                at = extra_at[k] - b
                controller_ms += accept_draft(gen, drafts[k], token,
                                              predicted[at : at + len(drafts[k]) - 1],
                                              self._take_token)
        for k, directive in deferred.items():
            gen = gens[k]
            if gen is not None:
                self._commit_directive(gen, directive, times)
        return controller_ms

    @staticmethod
    def _fail(gens: list[Generation | None], failed: dict[int, ControllerError]) -> list[int]:
        """Rows whose mask failed (or allows nothing) cannot sample: their error is their
        finish. Returns their positions."""
        for k, err in failed.items():
            gen = gens[k]
            assert gen is not None
            gen.finish = Finish("error", (err.type, err.message))
        return list(failed)

    def _release(self, rows: list[int], gens: list[Generation | None], ks: Iterable[int],
                 emit: Emit) -> None:
        """Free the rows of the generations at positions `ks` that finished, and emit
        their results. A released position is None in `gens` from then on."""
        for k in ks:
            gen = gens[k]
            if gen is None or gen.finish is None:
                continue
            self.rows.release(rows[k])
            self._finish(gen, emit)
            gens[k] = None

    # ----------------------------------------------------------------------- admission

    def _start(self, item: Job | LineError, emit: Emit) -> list[Generation]:
        """The generations of an input item that need a row: its `n` samples with their
        controllers. A line error, or a failure to tokenize or to build a controller,
        becomes that line's error result (and [])."""
        if isinstance(item, LineError):
            emit(error_result(item))
            return []
        job = item
        try:
            prompt_ids = self._tokenize(job)
            controllers = [self._controller(job) for _ in range(job.n)]
        except (GrammarError, ControllerError, ModelError) as e:
            emit(error_result(LineError(job.index, job.id, e.type, f"line {job.index}: {e}")))
            return []
        except Exception as e:  # a bug must cost this line only, not the run
            emit(error_result(LineError(job.index, job.id, "internal_error",
                                        f"line {job.index}: {type(e).__name__}: {e}")))
            return []
        group = SampleGroup(job.n, len(prompt_ids)) if job.n > 1 else None
        gens = []
        for i, controller in enumerate(controllers):
            gen = Generation(job, prompt_ids, controller, row_generator(job.seed, i),
                             started=self.now(), group=group, sample=i)
            if self.config.step_stats:
                gen.steps = []
            if controller is not None:
                self._consult(gen, functools.partial(controller.start, prompt_ids))
            self._check_limits(gen)
            gens.append(gen)
        waiting = []
        for gen in gens:
            if gen.finish is not None:
                self._finish(gen, emit)
            else:
                waiting.append(gen)
        return waiting

    def _tokenize(self, job: Job) -> list[int]:
        tok = self.lm.tokenizer
        if job.messages is not None:
            text = render_prompt(tok, job.messages)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(job.prompt)["input_ids"]
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

    def _controller(self, job: Job) -> Controller | None:
        if self.controller_factory is not None:
            custom = self.controller_factory(job)
            if custom is not None:
                return custom
        if job.constraint is None:
            return None
        return GrammarController(self.compiler.compile(job.constraint), self.config.fast_forward)

    def _finish(self, gen: Generation, emit: Emit) -> None:
        """Emit a finished generation's result, or, for a sample, the line's result once
        its last sample finishes."""
        result = generation_result(gen, self.lm.tokenizer, self.now())
        group = gen.group
        if group is None:
            emit(result)
            return
        group.results[gen.sample] = result
        if group.done:
            emit(combine_samples([r for r in group.results if r is not None]))

    # ------------------------------------------------------------------- controllers

    def _consult(self, gen: Generation,
                 ask: Callable[[], Directive | None]) -> tuple[bool, float]:
        """The one place a controller decides: run `ask`, apply its directive (None: the
        generation stops), and time it. A failure ends only this generation. Returns
        whether the output changed, and the controller's ms."""
        t0 = self.now()
        changed = False
        try:
            directive = ask()
            if directive is None:
                gen.finish = Finish("stop")
            else:
                changed = gen.apply(directive)
        except Exception as e:
            gen.finish = Finish("error", controller_fault(e))
        spent = ms(t0, self.now())
        gen.stats.controller_ms += spent
        return changed, spent

    def _take_token(self, gen: Generation, token: int) -> float:
        """`token` follows the generation's tokens (all in the cache): end at EOS (unless
        the controller takes it as a segment's end), or append it and ask the controller
        what follows. Returns the controller's ms."""
        controller = gen.controller
        if token in self.eos:
            if controller is None:
                gen.finish = Finish("stop")
                return 0.0
            _, spent = self._consult(gen, controller.on_eos)
            self._check_limits(gen)
            return spent
        gen.append(token)
        if self._check_limits(gen) or controller is None:
            return 0.0
        changed, spent = self._consult(gen, lambda: controller.advance([token]))
        if changed:  # only a changed output needs another look for stop strings
            self._check_limits(gen)
        return spent

    def _commit(self, gen: Generation, token: int, times: StepTimes) -> float:
        """The row took part in this pass and sampled `token`; returns the controller's
        ms."""
        self._account(gen, times)
        if gen.stats.ttft_ms == 0.0:
            gen.stats.ttft_ms = ms(gen.started, self.now())
        ff_before = gen.stats.ff_tokens
        controller_ms = self._take_token(gen, token)
        self._record_step(gen, times, sampled=0 if token in self.eos else 1,
                          ff_tokens=gen.stats.ff_tokens - ff_before,
                          controller_ms=controller_ms)
        return controller_ms

    def _commit_directive(self, gen: Generation, directive: Directive,
                          times: StepTimes) -> None:
        """The controller answered this pass with a directive instead of a mask (it was
        decided, and timed, in the mask worker): apply it in place of a sampled token
        (the pass's logits for this row go unused)."""
        self._account(gen, times)
        ff_before = gen.stats.ff_tokens
        try:
            gen.apply(directive)
        except Exception as e:
            gen.finish = Finish("error", controller_fault(e))
        self._check_limits(gen)
        self._record_step(gen, times, sampled=0, ff_tokens=gen.stats.ff_tokens - ff_before,
                          controller_ms=0.0)

    def _check_limits(self, gen: Generation) -> bool:
        """Finish on max_tokens or a stop string; True when the generation is finished."""
        if gen.finish is not None:
            return True
        if gen.job.stop:
            text = self.lm.tokenizer.decode(gen.output, skip_special_tokens=True)
            hit = find_stop(text, gen.job.stop, gen.text_checked)
            gen.text_checked = len(text)
            if hit is not None:
                gen.finish = Finish("stop", text_end=hit)
                return True
        if len(gen.output) >= gen.job.max_tokens:
            gen.finish = Finish("length")
            return True
        return False

    # ----------------------------------------------------------------------- accounts

    @staticmethod
    def _account(gen: Generation, times: StepTimes) -> None:
        """The row took part in this pass: its pending tokens are now in the cache."""
        st = gen.stats
        st.forward_passes += 1
        st.forward_ms += times.forward_ms
        st.mask_ms += times.mask_ms
        st.sample_ms += times.sample_ms
        gen.fed()

    @staticmethod
    def _record_step(gen: Generation, times: StepTimes, sampled: int, ff_tokens: int,
                     controller_ms: float) -> None:
        if gen.steps is None:
            return
        gen.steps.append({
            "step": len(gen.steps),
            "kind": "prefill" if gen.stats.forward_passes == 1 else "decode",
            "sampled": sampled,
            "forced": ff_tokens,  # the result format's name for fast-forward tokens
            "forward_ms": round(times.forward_ms, 3),
            "mask_ms": round(times.mask_ms, 3),
            "controller_ms": round(controller_ms, 3),
            "sample_ms": round(times.sample_ms, 3),
        })
