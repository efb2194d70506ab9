"""Where a run's lines decode: a `Backend` (protocol.py) that `runner.run_batch` drives.

    protocol  `Backend`: what the run asks of wherever its lines decode
    build     `build_engine`: one loaded model, its `Engine` and the `--controller`
              factory; the one way both this process and each Ray worker build theirs
    local     `LocalEngine`: the backend of a run in this process

The Ray backend (`aici_cli.distributed.driver.RayBackend`) builds its workers' engines
with `build.build_engine` too. Importing this package imports nothing heavy; `build` and
`local` import torch through the engine.
"""
