"""`aici-batch report --html FILE`: a run as one self-contained page, to open from disk
and look at: the run's figures and gates, a table of its lines (sorted, filtered,
searched; rows drawn as they scroll), each line opened, the lines the constraint bent
most, the plots, the baseline.

    rows.py           the page's lines: a row each for the table, and what an opened line shows
    inputs.py         `--input`: the run's input lines, for prompts and the schemas outputs met
    schema_errors.py  why an invalid output is invalid: its errors with their JSON paths
    svg.py            just enough SVG, written as text, for the plots
    step_plot.py      `--plot`'s figure as SVG: the step split and the step times
    timeline_plot.py  `--timeline`'s: the lines over wall time, the steps under them
    payload.py        the data held once: JSON, gzip + base64 where that pays
    write.py          the page: the template of `assets/`, the data and the plots in one file

The page's own code is package data under `assets/`: the template `assets/page.html`
and its style `assets/page.css`, and the scripts `assets/util.js`, `assets/run.js` (the
run, the lines the constraint bent most, the baseline, the plots), `assets/table.js`
(the table), `assets/line.js` (a line opened) and `assets/boot.js` (unpack the data,
draw), inlined in that order. Its data is the very summary `report --json` prints, with
the rows and lines.
"""
