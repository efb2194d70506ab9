"""`aici-batch report`: a finished run's figures rebuilt from its results, and in CI its
gates, baseline comparison, JUnit and Markdown.

    summarize  the summary from a results file (the run's own tally), optionally plotted
    lines      one result line as the CI outputs see it
    checks     the gates, the baseline, JUnit and Markdown from one pass over the results
    gate, baseline, junit, markdown   each of those;  plot, timeline   the PNGs
"""
