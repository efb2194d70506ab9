"""The words every layer speaks, and nothing else: the bottom layer, importing no other
part of `aici_cli`.

    job          Job (one input line, ready to run), BadLine, error_result
    constraint   Constraint (what a line's output must match)
    config       frozen settings: EngineConfig, RunConfig and their parts
    line_stats   LineStats (a result's `stats`), StepTimes (one forward pass's timings)
    errors       the two tiers of errors: a line's failure, or the run's

Torch-free: the CLI imports it at start-up.
"""
