"""Where a run's lines decode: a `Backend` (protocol.py) that `run.batch.run_batch` drives.

    protocol        `Backend`: what the run asks of wherever its lines decode
    build           `build_engine`: one loaded model, its `Engine` and the `--controller`
                    factory; the one way an engine process, an inline run and each Ray
                    worker build theirs
    local           `LocalEngine`: the engine in the run's own process (`--engine-process
                    inline`, and traced runs)
    supervised      `SupervisedEngine`: the engine in a child process that the run
                    restarts when it dies (`--engine-process child`, the default)
    engine_process  one life of that child, seen from the run: start, send, receive, end
    engine_child    the child itself (`python -m aici_cli.run.backends.engine_child`)
    child_messages  what the two say over their socket
    tool_relay      a controller's tool calls from that child, answered by the run
    progress_relay  the child's model-loading progress, shown by the run
    line_deaths     what a death costs each line in flight; `engine_crash`
    child_faults    the deaths the tests inject

The Ray backend (`aici_cli.run.distributed.driver.RayBackend`) builds its workers' engines
with `build.build_engine` too. Importing this package imports nothing heavy; `build`,
`local` and `engine_child` import torch through the engine, `supervised` and the modules
it uses do not (a supervised run's own process never imports torch).
"""
