"""`aici-batch report`: a finished run's figures rebuilt from its results, and in CI its
gates, baseline comparison, JUnit, Markdown and a page to look at.

    summarize.py  the summary from a results file (the run's own tally), optionally plotted
    lines.py      one result line as the CI outputs see it
    checks.py     the gates, the baseline, JUnit, Markdown and the page from one pass
    gate.py       `--fail-under`'s gates
    baseline.py   `--baseline`: the changed answers, the interval, McNemar's p
    junit.py      `--junit`
    markdown.py   `--markdown` and $GITHUB_STEP_SUMMARY
    plot.py       `--plot`'s PNG
    timeline.py   `--timeline`'s PNG, and the bars and steps it draws
    page/         `--html`: the run as one self-contained page

The summary of a 100,000-line results file takes ~2 s (bench/report_speed.py): a line
is parsed once, checked against the result-line schema by a validator compiled once
(`aici_cli.formats.schemas.schema_check`), and only an invalid one is searched for its
most relevant error.
"""
