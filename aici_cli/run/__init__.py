"""A run: read the input, drive a backend, write each result once, summarize.

    batch          `run_batch`, the library's entry point: the set-up as one straight line
    backends/      where lines decode: in a supervised child process, in this one
    distributed/   `--ray`: the same run over Ray actors
    controller_pin the `--controller` pinned to one digest (`control/registry/` pulls it)
    result_sink, result_writer, ordered, resume, out_paths, made_with   results out, once
    live_input, interrupts, threads, tally, summary, ui, tracing       the run around them
"""
