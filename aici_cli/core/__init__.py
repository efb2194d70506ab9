"""The words every layer speaks, and nothing else: the bottom layer, importing no other
part of `aici_cli`.

    job          Job (one input line, ready to run), BadLine, error_result
    constraint   Constraint (what a line's output must match)
    config       frozen settings: EngineConfig, RunConfig and their parts
    line_stats   LineStats (a result's `stats`), StepTimes (one forward pass's timings)
    errors       the two tiers of errors: a line's failure, or the run's
    sampling     Sampling (a line's sampling options), each option declared once
    json_text    a JSON value, type or field as one-line messages write it
    units        a byte count as messages write it (`byte_size`)
    suggest      the "did you mean" of a mistyped name (`did_you_mean`)
    cache_paths  where the caches live (`$AICI_BATCH_CACHE`)
    file_lock    a lock file, for caches that processes share

Torch-free: the CLI imports it at start-up.
"""
