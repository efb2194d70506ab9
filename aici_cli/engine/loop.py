"""The decode loop: rows refilled continuously, one batched forward pass per step.

A step, top to bottom:
  1. admit new lines into idle rows (their first pass is a prefill of the prompt plus any
     tokens their controller forces at the start);
  2. start filling token masks in a worker thread: they depend only on tokens already
     known, so they overlap the forward pass (llguidance and torch both release the GIL);
  3. one forward pass over the span of running rows, each feeding 1 sampled token,
     several forced ones (fast-forward) or, for a new line, its prompt: the tokens are
     packed without padding (inputs.py, attention.py), so a long chunk costs its own
     tokens only and new prompts ride along with the others' decoding;
  4. apply the masks in place, sample one token per row;
  5. hand each row's token to its controller, which answers with forced tokens,
     backtrack or stop; finished rows emit their result and free their row.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

from aici_cli.config import EngineConfig
from aici_cli.control.base import Controller, Directive
from aici_cli.control.grammar import GrammarCompiler, GrammarController
from aici_cli.engine.attention import install
from aici_cli.engine.cache import RowCache
from aici_cli.engine.draft import lookup
from aici_cli.engine.inputs import MaskShape, build_inputs, forward
from aici_cli.engine.sampling import MIN_TEMPERATURE, row_generator, sample
from aici_cli.engine.sequence import Family, Finish, Sequence
from aici_cli.errors import ControllerError, GrammarError, ModelError
from aici_cli.jobs import Job, LineError, error_result
from aici_cli.models import LoadedModel, render_prompt
from aici_cli.stats import StepTimes

# Prompt tokens one pass takes on; further new rows wait for the next pass. Bounds the
# activations of a pass (and its latency for the rows already decoding).
PREFILL_TOKENS_PER_PASS = 4096

ControllerFactory = Callable[[Job], "Controller | None"]


@dataclass
class MaskResult:
    """What the mask worker hands back, by position in the step's rows."""

    disallowed: torch.Tensor | None  # [b, V] bool; None: every token allowed everywhere
    failed: dict[int, ControllerError]
    deferred: dict[int, Directive]  # the controller answered with a directive, not a mask


def controller_fault(e: Exception) -> tuple[str, str]:
    """(type, message) of a controller failure; anything but a ControllerError is a bug in
    the host, reported as such but still confined to its sequence."""
    if isinstance(e, ControllerError):
        return e.type, e.message
    return "internal_error", f"{type(e).__name__}: {e}"


def is_out_of_memory(e: BaseException) -> bool:
    """CUDA raises OutOfMemoryError; the CPU allocator raises a RuntimeError saying so."""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and (
        "out of memory" in str(e) or "can't allocate memory" in str(e))


def combine_samples(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result line for a line's n samples, in sample order.

    The top level mirrors sample 0 (text, finish_reason, json, ...), so a reader that takes
    one answer per line still works; `choices` holds every sample with its own text,
    finish reason and stats; the top-level `stats` add up the samples' work. If a sample
    failed, the line's finish_reason is "error" with that sample's error.
    """
    line = {k: v for k, v in results[0].items() if k != "steps"}
    line["n"] = len(results)
    line["choices"] = [
        {"index": i, **{k: v for k, v in r.items() if k not in ("id", "index")}}
        for i, r in enumerate(results)
    ]
    stats: dict[str, Any] = {}
    for r in results:
        for key, value in r.get("stats", {}).items():
            stats[key] = round(stats.get(key, 0) + value, 3)
    stats["ttft_ms"] = min((r["stats"]["ttft_ms"] for r in results if r["stats"]["ttft_ms"]),
                           default=0.0)
    stats["total_ms"] = max(r["stats"]["total_ms"] for r in results)
    line["stats"] = stats
    failed = next((r for r in results if r["finish_reason"] == "error"), None)
    if failed is not None:
        line["finish_reason"] = "error"
        line["error"] = failed["error"]
    return line


def ms(t0: float, t1: float) -> float:
    return (t1 - t0) * 1000.0


class Engine:
    """Runs jobs on one loaded model. `run` emits one result dict per job or line error."""

    def __init__(self, lm: LoadedModel, config: EngineConfig,
                 controller_factory: ControllerFactory | None = None) -> None:
        self.lm = lm
        self.config = config
        self.model = lm.model
        self.vocab_size = lm.vocab_size
        self.eos = lm.eos_token_ids
        model_cfg = self.model.config
        self.max_positions = int(getattr(model_cfg, "max_position_embeddings", 1 << 15))
        self.mask_shape = MaskShape.for_config(model_cfg)
        install(self.model)
        self._compiler: GrammarCompiler | None = None
        self.controller_factory = controller_factory
        self.cache = RowCache(
            num_layers=int(model_cfg.num_hidden_layers),
            rows=config.batch_size,
            capacity=min(config.initial_capacity, self.max_positions),
        )
        self.rows: list[Sequence | None] = [None] * config.batch_size
        self.words = (self.vocab_size + 31) // 32
        # bitmask[i]: allowed tokens of row i (bit t = token t), written by llguidance.
        self.bitmask = torch.zeros((config.batch_size, self.words), dtype=torch.int32)
        self.executor = llguidance.LLExecutor()
        self.step_times: list[StepTimes] = []
        self.steps = 0
        # Rows that may run at once; lowered when a pass runs out of memory.
        self.live_cap = config.batch_size
        # Samples of admitted lines (n > 1) still waiting for a free row.
        self.waiting: deque[Sequence] = deque()

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
    def run(self, items: Iterable[Job | LineError], emit: Callable[[dict[str, Any]], None],
            should_admit: Callable[[], bool] = lambda: True) -> None:
        """Drive every item to exactly one `emit`ted result; returns when all are done."""
        source: Iterator[Job | LineError] | None = iter(items)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aici-mask")
        try:
            while True:
                # Samples of a line already started are admitted even after admission of
                # new lines stopped (an interrupt): the line must still get its result.
                pull = source is not None and should_admit()
                if pull or self.waiting:
                    source = self._admit(source, emit, pull)
                if not any(self.rows):
                    if not self.waiting and (source is None or not should_admit()):
                        return
                    continue
                self._step(emit)
        finally:
            self.pool.shutdown(wait=True)

    def _take_part(self) -> tuple[list[int], list[Sequence | None]]:
        """The span of live rows, and the sequence of each row taking part in this pass
        (None: idle, or a new row that waits: for the prefill budget, or for a sibling
        sample prefilling the same prompt in this pass)."""
        live = [i for i, s in enumerate(self.rows) if s is not None]
        rows = list(range(live[0], live[-1] + 1))
        seqs = [self.rows[i] for i in rows]
        budget = PREFILL_TOKENS_PER_PASS
        prefilling: set[int] = set()  # families whose prompt a row of this pass prefills
        for k, seq in enumerate(seqs):
            if seq is None or seq.length > 0:
                continue
            if seq.family is not None:
                if id(seq.family) in prefilling:
                    seqs[k] = None
                    continue
                source = self._prompt_row(seq.family)
                if source is not None:
                    self.cache.copy_prefix(source, rows[k], seq.family.prompt_len)
                    seq.adopt_prompt()
                    continue
            if budget <= 0:
                seqs[k] = None
                continue
            budget -= len(seq.pending)
            if seq.family is not None:
                prefilling.add(id(seq.family))
        return rows, seqs

    def _prompt_row(self, family: Family) -> int | None:
        """A row whose cache holds the family's prompt (a sibling past its prefill)."""
        for row, seq in enumerate(self.rows):
            if seq is not None and seq.family is family and seq.length >= family.prompt_len:
                return row
        return None

    def _admit(self, source: Iterator[Job | LineError] | None,
               emit: Callable[[dict[str, Any]], None],
               pull: bool) -> Iterator[Job | LineError] | None:
        """Fill idle rows, first with waiting samples, then (if `pull`) from `source`, up
        to `live_cap` rows in all; returns the source, or None once it is exhausted."""
        live = sum(s is not None for s in self.rows)
        for row in range(len(self.rows)):
            if self.rows[row] is not None:
                continue
            if live >= self.live_cap:
                break
            while not self.waiting:
                if not pull or source is None:
                    return source
                item = next(source, None)
                if item is None:
                    return None
                if isinstance(item, LineError):
                    emit(error_result(item))
                    continue
                for seq in self._start(item, emit):
                    if seq.finish is not None:
                        self._finish(seq, emit)
                    else:
                        self.waiting.append(seq)
            self.rows[row] = self.waiting.popleft()
            live += 1
        return source

    def _start(self, job: Job, emit: Callable[[dict[str, Any]], None]) -> list[Sequence]:
        """Tokenize and build the job's `n` samples with their controllers; a failure to
        tokenize or to build a controller becomes that line's error result (and [])."""
        try:
            prompt_ids = self._tokenize(job)
            controllers = [self._controller(job) for _ in range(job.n)]
        except (GrammarError, ControllerError, ModelError) as e:
            etype = e.type
            emit(error_result(LineError(job.index, job.id, etype, f"line {job.index}: {e}")))
            return []
        except Exception as e:  # a bug must cost this line only, not the run
            emit(error_result(LineError(job.index, job.id, "internal_error",
                                        f"line {job.index}: {type(e).__name__}: {e}")))
            return []
        family = Family(job.n, len(prompt_ids)) if job.n > 1 else None
        seqs = []
        for i, controller in enumerate(controllers):
            seq = Sequence(job, prompt_ids, controller, row_generator(job.seed, i),
                           family=family, sample=i)
            if self.config.step_stats:
                seq.steps = []
            if controller is not None:
                try:
                    t0 = time.perf_counter()
                    seq.apply(controller.start(prompt_ids))
                    seq.stats.controller_ms += ms(t0, time.perf_counter())
                except Exception as e:
                    seq.finish = Finish("error", controller_fault(e))
            self._check_limits(seq)
            seqs.append(seq)
        return seqs

    def _finish(self, seq: Sequence, emit: Callable[[dict[str, Any]], None]) -> None:
        """Emit a finished sequence's result, or, for a sample, the line's result once
        its last sample finishes."""
        result = self._result(seq)
        family = seq.family
        if family is None:
            emit(result)
            return
        family.results[seq.sample] = result
        if family.done:
            emit(combine_samples([r for r in family.results if r is not None]))

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

    # ---------------------------------------------------------------------------- step

    def _step(self, emit: Callable[[dict[str, Any]], None]) -> None:
        t_start = time.perf_counter()
        rows, seqs = self._take_part()
        fresh = any(s is not None and s.length == 0 for s in seqs)
        lengths = [s.length if s is not None else 0 for s in seqs]
        drafts = self._drafts(seqs)  # before the mask worker starts: both read matchers
        fed = sum(len(s.pending) for s in seqs if s is not None)
        fed += sum(len(d) - 1 for d in drafts if d)

        masks = self.pool.submit(self._masks, rows, seqs)  # overlaps the forward pass

        t0 = time.perf_counter()
        every, extra_at, out_of_memory = self._forward_drafts(rows[0], lengths, seqs, drafts)
        # In the model's dtype: masking and greedy argmax need no fp32 copy (a bf16 value
        # widens to fp32 exactly, so argmax is the same); `sample` widens what it samples
        # with temperature. `logits` [b, V] (a view): each row's next token after its real
        # tokens; draft positions follow in `every`.
        if every.shape[-1] > self.vocab_size:
            every = every[:, : self.vocab_size]
        logits = every[: len(seqs)]
        t1 = time.perf_counter()

        result = masks.result()
        disallowed, failed, deferred = result.disallowed, result.failed, result.deferred
        for k in out_of_memory:
            deferred.pop(k, None)
            failed[k] = ControllerError(
                "out_of_memory", "out of memory even with this sequence alone in the pass")
        t_mask_ready = time.perf_counter()
        if disallowed is not None:
            logits.masked_fill_(disallowed.to(logits.device, non_blocking=True), float("-inf"))
        t2 = time.perf_counter()
        best, greedy = logits.max(dim=-1)  # [b]: the greedy pick, and whether any is allowed
        if disallowed is not None:
            # A row whose mask allows nothing cannot continue; say so instead of sampling.
            for k in torch.isneginf(best).nonzero().flatten().tolist():
                if k not in deferred:
                    failed.setdefault(k, ControllerError("empty_mask", "the mask allows no token"))

        for k, err in failed.items():
            seq = seqs[k]
            assert seq is not None
            seq.finish = Finish("error", (err.type, err.message))
            self.rows[rows[k]] = None
            self._finish(seq, emit)
            seqs[k] = None
        real = [k for k, s in enumerate(seqs) if s is not None and k not in deferred]
        picked = sample(
            logits, greedy.tolist(), real,
            [seqs[k].job.temperature for k in real],  # type: ignore[union-attr]
            [seqs[k].job.top_p for k in real],  # type: ignore[union-attr]
            [seqs[k].generator for k in real],  # type: ignore[union-attr]
        )
        t3 = time.perf_counter()

        times = StepTimes(
            kind="prefill" if fresh else "decode",
            rows=len(real),
            tokens=fed,
            forward_ms=ms(t0, t1),
            mask_ms=ms(t1, t2),
            mask_wait_ms=ms(t1, t_mask_ready),
            sample_ms=ms(t2, t3),
        )
        # The model's own pick after every fed draft token, in one call for the batch.
        b = len(seqs)
        predicted = every[b:].argmax(dim=-1).tolist() if every.shape[0] > b else []
        controller_ms = 0.0
        for k, token in zip(real, picked):
            seq = seqs[k]
            assert seq is not None
            controller_ms += self._commit(seq, token, times)
            if drafts[k]:
                at = extra_at[k] - b
                controller_ms += self._accept_draft(
                    seq, drafts[k], token, predicted[at : at + len(drafts[k]) - 1])
        for k, directive in deferred.items():
            seq = seqs[k]
            if seq is not None:
                self._commit_directive(seq, directive, times)
        t4 = time.perf_counter()
        times.controller_ms = controller_ms
        times.step_ms = ms(t_start, t4)
        self.step_times.append(times)
        self.steps += 1
        for k in [*real, *deferred]:
            seq = seqs[k]
            if seq is not None and seq.finish is not None:
                self.rows[rows[k]] = None
                self._finish(seq, emit)

    def _drafts(self, seqs: list[Sequence | None]) -> list[list[int]]:
        """A prompt-lookup draft per row (empty: none): greedy rows past their prefill,
        with no controller or a grammar one, trimmed to what the grammar accepts, to
        the token budget and to before any end-of-sequence token."""
        drafts: list[list[int]] = [[] for _ in seqs]
        k = self.config.draft_tokens
        if k < 2:
            return drafts
        for i, seq in enumerate(seqs):
            if seq is None or seq.length == 0 or seq.job.temperature >= MIN_TEMPERATURE:
                continue
            controller = seq.controller
            if controller is not None and not hasattr(controller, "valid_prefix"):
                continue  # a wasm controller's next answer cannot be predicted
            n = min(k, seq.job.max_tokens - len(seq.output))
            if n < 2:
                continue
            draft = lookup(seq.prompt, seq.output, n)
            for j, token in enumerate(draft):
                if token in self.eos:
                    del draft[j:]
                    break
            if controller is not None and draft:
                del draft[controller.valid_prefix(draft):]  # type: ignore[attr-defined]
            if len(draft) >= 2:
                drafts[i] = draft
        return drafts

    def _forward_drafts(
        self, first_row: int, lengths: list[int], seqs: list[Sequence | None],
        drafts: list[list[int]],
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """The pass, with each row's draft (but its last token) fed after its pending
        tokens: logits for each row's next token (rows 0..b-1), then after each fed draft
        token (row i's from `extra_at[i]`), and the rows out of memory even alone.

        A draft d is checked against the logits after d[0..-2]: its last token needs no
        pass of its own. Out of memory, drafts are dropped and the pass retried as usual.
        """
        chunks = [s.pending if s is not None else [] for s in seqs]
        if any(drafts):
            fed = [c + d[:-1] for c, d in zip(chunks, drafts)]
            keep = [max(1, len(d)) for d in drafts]
            try:
                self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, fed)))
                inputs = build_inputs(first_row, lengths, fed, self.mask_shape,
                                      self.lm.device, keep)
                return forward(self.model, self.cache, inputs), inputs.extra_at, []
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                drafts[:] = [[] for _ in drafts]
        logits, out_of_memory = self._forward(first_row, lengths, chunks)
        return logits, [len(chunks)] * len(chunks), out_of_memory

    def _accept_draft(self, seq: Sequence, draft: list[int], picked: int,
                      predicted: list[int]) -> float:
        """Take the draft's tokens after `picked` while each is what the model predicts
        after the one before (`predicted[j]`: its unmasked argmax after draft[j]), so the
        output is what greedy decoding gives; stop at anything else the sequence does:
        finishing, forced tokens, a backtrack. Returns the controller's ms."""
        if draft[0] != picked or seq.finish is not None:
            return 0.0
        spent = 0.0
        previous = picked
        for token, expected in zip(draft[1:], predicted):
            # An allowed token that is the unmasked argmax is the masked argmax too.
            if token != expected or seq.finish is not None or seq.pending != [previous]:
                break
            # Ask again from the controller's current state: a segment may have ended
            # (its guest decides what follows) since the draft was checked.
            if seq.controller is not None and seq.controller.valid_prefix([token]) < 1:  # type: ignore[attr-defined]
                break
            seq.length += 1  # `previous` was fed in this pass as a draft token
            seq.pending = []
            spent += self._take_token(seq, token)
            seq.stats.draft_tokens += 1
            previous = token
        return spent

    def _forward(self, first_row: int, lengths: list[int],
                 chunks: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """One packed pass: the logits [b, V] of each row's last token, and the rows that
        could not run even alone for lack of memory.

        Out of memory, the same rows are run in two halves (same masks, same tokens: the
        step goes on unchanged; keys a failed pass wrote are rewritten at the same slots),
        and fewer rows are admitted from then on.
        """
        try:
            self.cache.ensure_capacity(max(a + len(c) for a, c in zip(lengths, chunks)))
            inputs = build_inputs(first_row, lengths, chunks, self.mask_shape, self.lm.device)
            return forward(self.model, self.cache, inputs), []
        except Exception as e:
            if not is_out_of_memory(e):
                raise
        active = [k for k, c in enumerate(chunks) if c]
        if len(active) == 1:
            logits = torch.zeros(len(chunks), self.vocab_size, dtype=self.lm.dtype,
                                 device=self.lm.device)
            return logits, active
        self.live_cap = max(1, min(self.live_cap, len(active) // 2))
        halves = active[: len(active) // 2], active[len(active) // 2 :]
        parts = [self._forward(first_row, lengths,
                               [c if k in half else [] for k, c in enumerate(chunks)])
                 for half in halves]
        logits = parts[0][0]
        logits[halves[1]] = parts[1][0][halves[1]]
        return logits, parts[0][1] + parts[1][1]

    def _masks(self, rows: list[int], seqs: list[Sequence | None]) -> MaskResult:
        """Runs in the worker thread, beside the forward pass.

        Returns the disallowed tokens [b, V] (None: all allowed), the controllers that
        failed, and the rows whose controller answered with a directive instead of a mask,
        all by position in `rows`.
        """
        failed: dict[int, ControllerError] = {}
        deferred: dict[int, Directive] = {}
        grammar: list[tuple[llguidance.LLMatcher, int]] = []
        grammar_k: list[tuple[int, Controller]] = []
        custom: list[tuple[int, int, Controller]] = []
        for k, (row, seq) in enumerate(zip(rows, seqs)):
            if seq is None or seq.controller is None:
                continue
            matcher = getattr(seq.controller, "matcher", None)
            if matcher is not None:  # llguidance-backed: filled in parallel with the others
                grammar.append((matcher, row))
                grammar_k.append((k, seq.controller))
            else:
                custom.append((k, row, seq.controller))
        if not grammar and not custom:
            return MaskResult(None, failed, deferred)
        if grammar:
            self.executor.unsafe_compute_mask_ptr(
                grammar, self.bitmask.data_ptr(), self.words * 4, self.bitmask.shape[0]
            )
            # A matcher that failed computing its mask (a per-step limit) allows only EOS:
            # end the row with its error here rather than sample that EOS.
            for (matcher, _), (k, controller) in zip(grammar, grammar_k):
                if matcher.is_error():
                    failed[k] = controller.fault()  # type: ignore[attr-defined]
        constrained = {row for _, row in grammar}
        for k, row, controller in custom:
            try:
                answer = controller.fill_mask(self.bitmask[row])
            except Exception as e:
                failed[k] = ControllerError(*controller_fault(e))
                continue
            if isinstance(answer, Directive):
                deferred[k] = answer
            elif answer:
                constrained.add(row)
        # Complement the words, then unpack: bit = 1 where the token is disallowed. One pass
        # over [b, V] instead of two (unpack, then compare); V/32 words are cheap to flip.
        words = ~self.bitmask.numpy()[rows]
        for k, row in enumerate(rows):
            if row not in constrained:
                words[k] = 0
        disallowed = np.unpackbits(words.view(np.uint8), axis=1, count=self.vocab_size,
                                   bitorder="little").view(np.bool_)
        return MaskResult(torch.from_numpy(disallowed), failed, deferred)

    def _account(self, seq: Sequence, times: StepTimes) -> None:
        """The row took part in this pass: its pending tokens are now in the cache."""
        st = seq.stats
        st.forward_passes += 1
        st.forward_ms += times.forward_ms
        st.mask_ms += times.mask_ms
        st.sample_ms += times.sample_ms
        seq.length += len(seq.pending)
        seq.pending = []

    def _commit_directive(self, seq: Sequence, directive: Directive, times: StepTimes) -> None:
        """The controller answered this pass with a directive instead of a mask: apply it
        in place of a sampled token (the pass's logits for this row go unused)."""
        self._account(seq, times)
        ff_before = seq.stats.ff_tokens
        try:
            seq.apply(directive)
        except Exception as e:
            seq.finish = Finish("error", controller_fault(e))
        self._check_limits(seq)
        self._record_step(seq, times, sampled=0, forced=seq.stats.ff_tokens - ff_before,
                          controller_ms=0.0)

    def _record_step(self, seq: Sequence, times: StepTimes, sampled: int, forced: int,
                     controller_ms: float) -> None:
        if seq.steps is None:
            return
        seq.steps.append({
            "step": len(seq.steps),
            "kind": "prefill" if seq.stats.forward_passes == 1 else "decode",
            "sampled": sampled,
            "forced": forced,
            "forward_ms": round(times.forward_ms, 3),
            "mask_ms": round(times.mask_ms, 3),
            "controller_ms": round(controller_ms, 3),
            "sample_ms": round(times.sample_ms, 3),
        })

    def _commit(self, seq: Sequence, token: int, times: StepTimes) -> float:
        """Append the sampled token, ask the controller what follows; returns its ms."""
        now = time.perf_counter()
        st = seq.stats
        self._account(seq, times)
        if st.ttft_ms == 0.0:
            st.ttft_ms = ms(seq.started, now)
        ff_before = st.ff_tokens
        controller_ms = self._take_token(seq, token)
        self._record_step(seq, times, sampled=0 if token in self.eos else 1,
                          forced=st.ff_tokens - ff_before, controller_ms=controller_ms)
        return controller_ms

    def _take_token(self, seq: Sequence, token: int) -> float:
        """`token` follows the sequence's tokens (all in the cache): end at EOS, or append
        it and apply the controller's answer. Returns the controller's ms."""
        st = seq.stats
        controller_ms = 0.0
        on_eos = getattr(seq.controller, "on_eos", None)
        if token in self.eos and on_eos is not None:
            # The controller may treat end-of-sequence as the end of a segment only.
            t0 = time.perf_counter()
            try:
                directive = on_eos()
                if directive is None:
                    seq.finish = Finish("stop")
                else:
                    seq.apply(directive)
            except Exception as e:
                seq.finish = Finish("error", controller_fault(e))
            controller_ms = ms(t0, time.perf_counter())
            st.controller_ms += controller_ms
            self._check_limits(seq)
        elif token in self.eos:
            seq.finish = Finish("stop")
        else:
            seq.output.append(token)
            seq.pending.append(token)
            if seq.controller is not None and not self._check_limits(seq):
                t0 = time.perf_counter()
                changed = False
                try:
                    directive = seq.controller.advance([token])
                    seq.apply(directive)
                    changed = bool(directive.forced or directive.backtrack)
                except Exception as e:
                    seq.finish = Finish("error", controller_fault(e))
                controller_ms = ms(t0, time.perf_counter())
                st.controller_ms += controller_ms
                if changed:  # only a changed output needs another look for stop strings
                    self._check_limits(seq)
            elif seq.controller is None:
                self._check_limits(seq)
        return controller_ms

    def _check_limits(self, seq: Sequence) -> bool:
        """Finish on max_tokens or a stop string; True when the sequence is finished."""
        if seq.finish is not None:
            return True
        if seq.job.stop:
            text = self.lm.tokenizer.decode(seq.output, skip_special_tokens=True)
            longest = max(len(s) for s in seq.job.stop)
            start = max(0, seq._text_checked - longest + 1)
            hits = [p for p in (text.find(s, start) for s in seq.job.stop) if p >= 0]
            seq._text_checked = len(text)
            if hits:
                seq.finish = Finish("stop", text_end=min(hits))
                return True
        if len(seq.output) >= seq.job.max_tokens:
            seq.finish = Finish("length")
            return True
        return False

    def _result(self, seq: Sequence) -> dict[str, Any]:
        finish = seq.finish or Finish("error", ("internal_error", "sequence ended unfinished"))
        text = self.lm.tokenizer.decode(seq.output, skip_special_tokens=True)
        if finish.text_end is not None:
            text = text[: finish.text_end]
        seq.stats.output_tokens = len(seq.output)
        seq.stats.total_ms = ms(seq.started, time.perf_counter())
        result: dict[str, Any] = {
            "id": seq.job.id,
            "index": seq.job.index,
            "text": text,
            "finish_reason": finish.reason,
        }
        if seq.controller is not None:
            result.update(seq.controller.report(text))
        if finish.error is not None:
            etype, message = finish.error
            result["error"] = {"type": etype, "message": f"line {seq.job.index}: {message}"}
        result["stats"] = seq.stats.as_dict()
        for split in ("guest_ms", "segment_ms"):  # wasm controllers: where controller_ms went
            if hasattr(seq.controller, split):
                result["stats"][split] = round(float(getattr(seq.controller, split)), 3)
        close = getattr(seq.controller, "close", None)
        if close is not None:
            close()
        if seq.steps is not None:
            result["steps"] = seq.steps
        return result
