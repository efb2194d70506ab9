"""From a pass's logits to a token: tensors and plain data only, never a `Generation`.

    masks        the controllers' token masks, filled on a worker thread, applied in place
    logit_rules  penalties, `logit_bias` and `min_tokens` (`LogitRules`)
    sampling     one token a row: temperature, top-p, top-k, min-p, seeded generators
    logprobs     per-token logprobs and their top rivals
"""
