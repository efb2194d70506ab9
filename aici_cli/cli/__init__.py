"""The front door: `aici-batch`'s commands, thin over the library (Click).

    main           the group, `run` and the small commands (`wit`, `build`, `lm-eval`)
    run_options    `run`'s options, declared once, and their `AICI_BATCH_<NAME>` variables
    run_config     those options made into one `RunConfig`
    option_values  the constraint options as users write them (`--choices`, `--json-schema`)
    report         `report`;  models  `models`;  doctor  `doctor`;  registry  `publish`, `pull`
    errors         `FatalError`, the one-line exit the commands share
"""
