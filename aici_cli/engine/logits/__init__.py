"""From a pass's logits to a token: tensors and plain data only, never a `Generation`.

    masks.py              the controllers' token masks, filled on a worker thread, applied
                          in place
    masked_projection.py  the output projection at the few tokens a row's mask allows
                          (`MaskedProjection`), when the pass stops at hidden states
    logit_rules.py        penalties, `logit_bias` and `min_tokens` (`LogitRules`)
    sampler.py            one token a row: temperature, top-p, top-k, min-p, seeded
                          counter-based streams (the options themselves: `core/sampling.py`)
    logprobs.py           per-token logprobs and their top rivals
"""
