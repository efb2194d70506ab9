"""Evaluation harnesses on this engine: lm-evaluation-harness's `LM` (`lm_eval_backend`).

    requests         lm-eval requests -> engine lines (torch-free): scored contexts grouped,
                     gen_kwargs read as line fields (constraints included)
    token_intake     the engine's intake for lines whose token ids are given
    lm_eval_backend  `AiciBatchLM`, registered with lm-eval as "aici-batch"
    harness          `aici-batch lm-eval`: lm-eval's own command line, with the model registered

Needs the `lm-eval` extra (`pip install 'aici-batch[lm-eval]'`); nothing outside this
package imports it.
"""

from __future__ import annotations


def harness_problem() -> str | None:
    """Why lm-eval cannot run here (it is not installed), or None. (Importing `lm_eval`
    itself is light: its evaluator loads on first use.)"""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return "lm-eval is not installed: pip install 'aici-batch[lm-eval]'"
    return None
