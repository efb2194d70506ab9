"""Connecting to Ray and starting the workers: one actor per worker, each with its share
of the cluster (`num_cpus`, `num_gpus`), restarted by Ray when its process dies."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from aici_cli.core.config import RayOptions, RunConfig
from aici_cli.core.errors import ClusterError, ModelError, UsageError

_log = logging.getLogger(__name__)

# Restarts Ray grants one worker. A line that kills its worker costs at most
# driver.LINE_LOSSES of them before it ends as `worker_lost`; the rest cover crashes of
# the node or process that no line caused.
WORKER_RESTARTS = 8


@dataclass
class Worker:
    """The driver's view of one actor."""

    name: str
    actor: Any  # ray.actor.ActorHandle
    info: dict[str, Any] = field(default_factory=dict)  # EngineWorker.ready()
    in_flight: int = 0  # chunks handed to it and not finished
    up: bool = True  # False from a loss until Ray's restart answers `ready`
    dead: bool = False  # out of restarts: never used again
    epoch: int = 0  # +1 per loss, so that one death's many failed chunks count once
    reserved: bool = False  # kept free for (or running) a line that runs alone
    losses: int = 0
    probe_failures: int = 0
    lines: int = 0
    output_tokens: int = 0

    def takes(self, cap: int) -> bool:
        """Whether an ordinary chunk may go to this worker now."""
        return self.up and not self.dead and not self.reserved and self.in_flight < cap


def connect(options: RayOptions, quiet: bool) -> bool:
    """Connect to Ray (`auto`: RAY_ADDRESS, a running local cluster, or a new local
    instance; `ray://host:port`: Ray Client; `host:port`: a cluster's GCS). Returns
    whether this call connected (and so should disconnect); a process already connected
    (a test, a notebook) keeps its connection."""
    if ray.is_initialized():
        return False
    address = None if options.address == "auto" else options.address
    client = address is not None and address.startswith("ray://")
    if client:
        _client_token_auth()
    # ray.init sets a SIGTERM handler that exits at once; the run's own (`Interrupts`:
    # finish the lines in flight, then exit 143) must stay.
    handlers = _signal_handlers()
    try:
        _init(address, quiet, attempts=CLIENT_INIT_ATTEMPTS if client else 1)
    except (ConnectionError, ValueError, RuntimeError) as e:
        hint = ""
        if client and os.environ.get(AUTH_MODE) != "token":
            hint = (f" (a cluster that requires Ray's token authentication needs {AUTH_MODE}=token "
                    "and its token in ~/.ray/auth_token or RAY_AUTH_TOKEN)")
        raise UsageError(
            f"--ray {options.address}: cannot connect: {_first_line(e)}{hint}") from None
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return True


AUTH_MODE = "RAY_AUTH_MODE"

# Attempts at a Ray Client connection whose server failed to set its session up. The
# client server starts a process per client; on a loaded head that start can fail once
# and succeed on the next connection (Ray reports it as `Initialization failure from
# server`, at times with no detail). Any other error is the user's to see at once.
CLIENT_INIT_ATTEMPTS = 3
CLIENT_INIT_BACKOFF_S = 2.0


def _init(address: str | None, quiet: bool, attempts: int) -> None:
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address=address, include_dashboard=False, log_to_driver=not quiet,
                     logging_level=logging.WARNING if quiet else logging.INFO)
            return
        except ConnectionAbortedError as e:  # the server's session set-up, not the address
            if attempt == attempts:
                raise
            wait = CLIENT_INIT_BACKOFF_S * 2 ** (attempt - 1)
            if not quiet:
                _log.warning("--ray %s: the server could not start a session (%s); "
                             "connecting again in %.0f s", address, _first_line(e), wait)
            # Ray's client disconnects itself on a failed set-up; make sure of it, or the
            # next `ray.init` would find a half-open client.
            with contextlib.suppress(Exception):
                ray.shutdown()
            time.sleep(wait)


def _client_token_auth() -> None:
    """Turn Ray's token authentication on for a Ray Client connection when a token is at
    hand and the mode is not set. `ray.init` does this itself for a GCS address, but not
    for `ray://`, whose server then refuses the unauthenticated client with a bare
    timeout; clusters Ray starts require the token by default."""
    if AUTH_MODE in os.environ:
        return  # the user's explicit choice
    try:  # Ray's own switch: the variable, and its config cache refreshed
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    # It says so with a logging warning; a run reports errors only.
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    finally:
        logger.setLevel(level)


def _signal_handlers() -> dict[int, Any]:
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)
            if signal.getsignal(sig) is not None}


def check_resources(options: RayOptions) -> None:
    """Refuse a request the cluster cannot place at all (the actors would wait forever)."""
    total = ray.cluster_resources()
    for what, each, flag in (("CPU", options.cpus_per_worker, "--cpus-per-worker"),
                             ("GPU", options.gpus_per_worker, "--gpus-per-worker")):
        need = options.workers * each
        have = float(total.get(what, 0.0))
        if need > have + 1e-9:
            raise UsageError(
                f"--workers {options.workers} with {flag} {each:g} needs {need:g} {what}s; "
                f"the Ray cluster has {have:g} (use fewer workers or a smaller {flag})")


def start_workers(config: RunConfig, wasm: bytes | None) -> list[Worker]:
    """Start the workers and wait until each has loaded the model (and compiled the
    controller). A model or controller that cannot load raises the local run's error."""
    from aici_cli.run.distributed.worker import EngineWorker

    options = config.ray
    assert options is not None
    run = uuid.uuid4().hex[:8]
    actor_class = ray.remote(EngineWorker)
    # The component's bytes go to the object store once; each node pulls them once.
    wasm_ref = ray.put(wasm) if wasm is not None else None
    workers = []
    for i in range(options.workers):
        name = f"aici-batch-{run}-w{i}"
        actor = actor_class.options(
            name=name,
            num_cpus=options.cpus_per_worker,
            num_gpus=options.gpus_per_worker,
            max_restarts=WORKER_RESTARTS,
            # No task retries: the driver gives a lost chunk's unfinished lines to any
            # worker, and never runs a line again once its result is written.
            max_task_retries=0,
            # Its chunks in flight at once, plus `ready` and `pid`.
            max_concurrency=options.chunks_in_flight + 2,
            scheduling_strategy="SPREAD",
        ).remote(name, config, wasm_ref)
        workers.append(Worker(name, actor))
    try:
        _wait_ready(workers)
    except BaseException:  # a load error, or Ctrl-C while the models load
        stop_workers(workers, disconnect=False)
        raise
    return workers


def _wait_ready(workers: list[Worker]) -> None:
    try:
        infos = ray.get([w.actor.ready.remote() for w in workers])
    except ray.exceptions.RayError as e:  # the actor itself failed (aici-batch missing?)
        raise ClusterError(f"a Ray worker could not start: {_first_line(e)}") from None
    for worker, info in zip(workers, infos):
        _raise_load_error(info)
        worker.info = info


def _raise_load_error(info: dict[str, Any]) -> None:
    """The error a worker kept from loading, raised as the local run would raise it."""
    error = info.get("error")
    if error is None:
        return
    kind, message = error
    if kind == "usage":
        raise UsageError(message)
    if kind == "model":
        raise ModelError(message)
    raise ClusterError(f"a Ray worker could not start: {message}")


def component_bytes(config: RunConfig) -> bytes | None:
    """The `--controller` component's binary, read here (its errors are the local run's)
    and shipped to the workers: their nodes need no copy of the file."""
    if config.controller is None:
        return None
    from aici_cli.control.registry.operations import controller_file
    from aici_cli.control.wasm.component_file import ComponentError, read_wasm

    try:
        return read_wasm(controller_file(config.controller))
    except ComponentError as e:
        raise UsageError(str(e)) from None


def stop_workers(workers: list[Worker], disconnect: bool) -> None:
    for worker in workers:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(worker.actor, no_restart=True)
    if disconnect:
        ray.shutdown()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
