"""Prompt-lookup drafts: guess a greedy row's next tokens from its own history.

Constrained outputs repeat themselves: keys and values copied from the prompt's schema,
array items, and the loops a small model falls into. If the last few tokens occurred
before, the tokens that followed them then are a cheap guess for what follows now. The
engine feeds such a draft after the row's real tokens and keeps the longest prefix the
model itself would have produced (greedy argmax), so outputs are unchanged and a run of
correct guesses costs one pass instead of one per token.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Sequence

from aici_cli.engine.generation import Generation
from aici_cli.engine.sampling import MIN_TEMPERATURE

# Longest and shortest history suffix looked up; longer matches predict better.
MAX_NGRAM = 3
MIN_NGRAM = 1

# A draft pays only if the tokens it brings outweigh what it adds to the pass. Measured at
# batch 1 on the 2-core CPU (default model, ~4 draft tokens a pass): an eager pass with a
# draft costs 1.14x (int4) and 1.16x (bf16) a one-token pass; where the step would
# otherwise run compiled (compiled.py) the draft makes it eager: 2.1x (int4), 1.5x
# (bf16). So a row drafts only while its drafts bring at least the MIN_GAIN extra tokens
# a pass (a running mean, optimistic at first), and tries again after some tokens without
# a draft: outputs that start repeating themselves (a JSON array's items, a loop) are
# drafted again. The wait doubles with each pass in a row that brought nothing, from
# RETRY_AFTER tokens up to RETRY_AFTER << MAX_BACKOFF. The gate reads no clock, so the
# passes a run makes are the same every time.
EAGER_MIN_GAIN = 0.15
COMPILED_MIN_GAIN = 1.0
RETRY_AFTER = 32
MAX_BACKOFF = 4


def lookup(prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
    """Up to `k` tokens that followed an earlier occurrence of the longest matching suffix
    (MAX_NGRAM down to MIN_NGRAM tokens) of `prompt + output`: the most recent one that
    still has `k` tokens after it (in a run like `x x x x` the most recent is followed by
    one token only), else the most recent.

    Searches bytes with `rfind` (C speed): ~20 us for a 1,000-token history.
    """
    hist = array("I", prompt)
    hist.extend(output)
    total = len(hist)
    data = hist.tobytes()
    width = hist.itemsize
    for n in range(min(MAX_NGRAM, total - 1), MIN_NGRAM - 1, -1):
        tail = data[(total - n) * width :]
        # Occurrences must end before the last token; first look where k tokens follow.
        for last_end in (total - k, total - 1):
            at = _rfind_aligned(data, tail, last_end * width, width)
            if at is not None:
                start = at + n
                return hist[start : start + k].tolist()
    return []


def _rfind_aligned(data: bytes, tail: bytes, end: int, width: int) -> int | None:
    """Token index of the last occurrence of `tail` ending at or before byte `end`,
    starting on a token boundary (rfind may also match inside tokens)."""
    while end >= len(tail):
        at = data.rfind(tail, 0, end)
        if at < 0:
            return None
        if at % width == 0:
            return at // width
        end = at + len(tail) - 1
    return None


def worth_drafting(gen: Generation, compiled: bool) -> bool:
    """Whether `gen` drafts this step; `compiled`: without drafts the step would run
    compiled."""
    min_gain = COMPILED_MIN_GAIN if compiled else EAGER_MIN_GAIN
    return (gen.draft_gain >= min_gain
            or len(gen.output) - gen.drafted_at >= retry_wait(gen))


def retry_wait(gen: Generation) -> int:
    """Tokens without a draft before a row whose drafts stopped paying tries again."""
    return RETRY_AFTER << min(max(gen.draft_misses - 1, 0), MAX_BACKOFF)


def propose_drafts(gens: Sequence[Generation | None], k: int,
                   eos: Collection[int], compiled: bool = False) -> list[list[int]]:
    """A draft per row (empty: none) of up to `k` tokens: greedy rows past their prefill,
    trimmed to what their controller accepts (a wasm guest's next answer cannot be
    predicted: it accepts none), to the token budget and to before any end-of-sequence or
    stop token id. A row with logit rules is checked under them (`penalties.draft_picks`).
    Rows whose drafts have not been paying do not draft (`worth_drafting`; `compiled`:
    drafting would turn a compiled step eager)."""
    drafts: list[list[int]] = [[] for _ in gens]
    if k < 2:
        return drafts
    for i, gen in enumerate(gens):
        if (gen is None or gen.length == 0 or gen.score_from is not None
                or gen.finish is not None
                or gen.job.temperature >= MIN_TEMPERATURE
                or not worth_drafting(gen, compiled)):
            continue
        n = min(k, gen.job.max_tokens - len(gen.output))
        if n < 2:
            continue
        draft = lookup(gen.prompt, gen.output, n)
        stop_ids = gen.job.stop_token_ids
        for j, token in enumerate(draft):
            if token in eos or token in stop_ids:
                del draft[j:]
                break
        if gen.controller is not None and draft:
            del draft[gen.controller.valid_prefix(draft):]
        if len(draft) >= 2:
            drafts[i] = draft
    return drafts


def accept_draft(gen: Generation, draft: Sequence[int], picked: int,
                 predicted: Sequence[int], take: Callable[[Generation, int], float]) -> float:
    """Take the draft's tokens after `picked` while each is what the model predicts after
    the one before (`predicted[j]`: its unmasked argmax after draft[j], under the line's
    penalties and biases), so the output is
    what greedy decoding gives; stop at anything else the generation does: finishing,
    fast-forward tokens, a backtrack. `take` appends a token as if it had been sampled
    and returns the controller's ms; returns their sum."""
    taken = gen.stats.draft_tokens
    spent = _accept(gen, draft, picked, predicted, take)
    brought = gen.stats.draft_tokens - taken
    gen.draft_gain = (gen.draft_gain + brought) / 2
    gen.drafted_at = len(gen.output)
    gen.draft_misses = 0 if brought else gen.draft_misses + 1
    return spent


def _accept(gen: Generation, draft: Sequence[int], picked: int,
            predicted: Sequence[int], take: Callable[[Generation, int], float]) -> float:
    if draft[0] != picked or gen.finish is not None:
        return 0.0
    spent = 0.0
    previous = picked
    for token, expected in zip(draft[1:], predicted):
        # An allowed token that is the unmasked argmax is the masked argmax too.
        if (token != expected or gen.finish is not None or gen.fork_wanted
                or gen.pending != [previous]):
            break
        # Ask again from the controller's current state: a segment may have ended
        # (its guest decides what follows) since the draft was checked.
        if gen.controller is not None and gen.controller.valid_prefix([token]) < 1:
            break
        gen.fed_draft_token()  # `previous` was fed in this pass as a draft token
        spent += take(gen, token)
        gen.stats.draft_tokens += 1
        previous = token
    return spent
