"""Prompt-lookup drafts: guess a greedy row's next tokens from its own history.

Constrained outputs repeat themselves: keys and values copied from the prompt's schema,
array items, and the loops a small model falls into. If the last few tokens occurred
before, the tokens that followed them then are a cheap guess for what follows now. The
engine feeds such a draft after the row's real tokens and keeps the longest prefix the
model itself would have produced (greedy argmax), so outputs are unchanged and a run of
correct guesses costs one pass instead of one per token.

The scheduler picks the rows that draft and proposes their drafts (`propose`); the update
takes the tokens the model confirmed (`update.accept_draft`) and tells each row's
`DraftGate` what its pass brought.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

# Longest and shortest history suffix looked up; longer matches predict better.
MAX_NGRAM = 3
MIN_NGRAM = 1

# A draft pays only if the tokens it brings outweigh what it adds to the pass. An eager
# pass costs about c0 + c1 T for T tokens fed: c0 the fixed cost of a pass (its ~45 ops a
# layer dispatched, the attention's read of every row's keys), c1 each token's (the
# layers' products). R rows share a pass, so a token a draft brings saves its row c0 / R
# + c1, and each of the draft's d tokens fed after the first costs c1: a row's drafts pay
# while they bring at least d R / (PASS_COST_TOKENS + R) extra tokens a pass, with
# PASS_COST_TOKENS = c0 / c1 (`eager_min_gain`). Fitted over the eager passes of 32
# dev-half schemas at batch 8 (default model, int4, forced to AVX2, 2 cores): c0 = 14-17
# ms, c1 = 1.37 ms, c0 / c1 ~ 10-12; at batch 1 on the AMX Xeon a 4-token draft made a
# pass 1.14x a one-token pass (c0 / c1 ~ 20). At R = 1 a row drafts from 0.23 extra
# tokens a pass; at R = 8, from 1.2: a batch of 8 that drafted from 0.15 fed 555 draft
# tokens and kept 231, and ran slower than without drafts.
# Where the step would otherwise run compiled (compiled.py, its package ready) the draft
# makes it eager: 2.7x (int4: 19.2 ms against 7.2 ms on the AMX Xeon, the int4 kernel's
# cost growing with the rows fed), 1.5x (bf16): a row drafts there only while its drafts
# bring COMPILED_MIN_GAIN. The gain is a running mean, optimistic at first (one pass that
# brings nothing ends a compiled row's drafting), and a row tries again after some
# tokens without a draft: outputs that start repeating themselves (a JSON array's items,
# a loop) are drafted again. The wait doubles with each pass in a row that brought
# nothing, from RETRY_AFTER tokens up to RETRY_AFTER << MAX_BACKOFF. The gate reads no
# clock, so the passes a run makes are the same every time.
PASS_COST_TOKENS = 12
COMPILED_MIN_GAIN = 1.7
RETRY_AFTER = 32
MAX_BACKOFF = 4


def eager_min_gain(rows: int, extra: int) -> float:
    """The extra tokens a pass a row's drafts must bring in an eager pass of `rows` rows,
    a draft feeding `extra` tokens after its first (see PASS_COST_TOKENS)."""
    return extra * rows / (PASS_COST_TOKENS + rows)


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


@dataclass
class DraftGate:
    """Whether a row's drafts pay: the extra tokens its recent draft passes brought (a
    running mean, optimistic at first), the output length at the last one, and how many
    passes in a row brought none."""

    gain: float = 2.0
    at: int = 0
    misses: int = 0

    def worth(self, output_len: int, compiled: bool, rows: int = 1, extra: int = 3) -> bool:
        """Whether the row drafts this step; `compiled`: without drafts the step would run
        compiled; else the eager pass has `rows` rows and a draft feeds `extra` tokens
        after its first."""
        min_gain = COMPILED_MIN_GAIN if compiled else eager_min_gain(rows, extra)
        return self.gain >= min_gain or output_len - self.at >= self.retry_wait()

    def retry_wait(self) -> int:
        """Tokens without a draft before a row whose drafts stopped paying tries again."""
        return RETRY_AFTER << min(max(self.misses - 1, 0), MAX_BACKOFF)

    def passed(self, brought: int, output_len: int) -> None:
        """A draft pass brought `brought` extra tokens; the output is `output_len` now."""
        self.gain = (self.gain + brought) / 2
        self.at = output_len
        self.misses = 0 if brought else self.misses + 1


def propose(prompt: Sequence[int], output: Sequence[int], k: int,
            stop_ids: Collection[int], eos: Collection[int],
            accepts: Callable[[list[int]], int] | None) -> list[int]:
    """A draft of up to `k` tokens (empty: none) for a greedy row past its prefill:
    trimmed to before any end-of-sequence or stop token id, and to what its controller
    `accepts` (a wasm guest's next answer cannot be predicted: it accepts none). A row
    with logit rules is checked under them (`logit_rules.draft_picks`)."""
    draft = lookup(prompt, output, k)
    for j, token in enumerate(draft):
        if token in eos or token in stop_ids:
            del draft[j:]
            break
    if accepts is not None and draft:
        del draft[accepts(draft):]
    return draft if len(draft) >= 2 else []
