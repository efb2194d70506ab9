"""A compiled run's tail moves its last lines down to the rows of a smaller graph
(`RowTable.compact`): what moves, where to, and which keys go with it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from aici_cli.engine.rows import RowTable


def _gen(tag: int, length: int, passes: int) -> Any:
    """What the table reads of a generation: its tokens, how many have keys, its passes."""
    prompt = [tag * 1000 + i for i in range(max(1, length))]
    return SimpleNamespace(prompt=prompt, output=[tag], length=length,
                           stats=SimpleNamespace(forward_passes=passes))


@given(st.lists(st.none() | st.tuples(st.integers(0, 40), st.integers(0, 3)),
                min_size=1, max_size=16),
       st.booleans())
def test_compaction_moves_started_lines_below_their_bound_and_names_their_keys(
        rows: list[tuple[int, int] | None], prefix_cache: bool) -> None:
    """Every generation keeps a row of its own; those that took a pass end below the
    smallest power of two that holds the live count wherever a row there is free, each
    with one copy of exactly its keys from its old row; the others do not move; a row a
    generation left holds its keys for later lines (prefix cache)."""
    table = RowTable(len(rows), prefix_cache)
    gens = [None if r is None else _gen(i + 1, *r) for i, r in enumerate(rows)]
    table.gens = list(gens)
    copies = table.compact()
    after = {id(g): i for i, g in enumerate(table.gens) if g is not None}
    before = {id(g): i for i, g in enumerate(gens) if g is not None}
    assert after.keys() == before.keys()  # the same generations, one row each
    moved = {(before[k], after[k]) for k in before if before[k] != after[k]}
    assert {(src, dst) for src, dst, _ in copies} == moved
    for src, dst, n in copies:
        gen = gens[src]
        assert gen is not None and gen.stats.forward_passes > 0 and n == gen.length > 0
        assert dst < src
        if prefix_cache:
            assert table.held[src].tolist() == (gen.prompt + gen.output)[:n]
    bound = 1 << (len(before) - 1).bit_length() if before else 0
    movable = [g for g in gens[bound:] if g is not None and g.stats.forward_passes > 0
               and g.length > 0]
    free_below = sum(g is None for g in gens[:bound])
    assert len(copies) == min(len(movable), free_below)
