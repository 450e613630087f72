"""``specserve serve``: the application on a local (or given) Ray cluster, until Ctrl-C.

Joins Ray as every command that spawns replicas does (:func:`~specserve.cluster.connect.connect_ray`:
``--ray-address``, the ``specserve cluster up`` cluster, or a private Ray on 127.0.0.1 sized for
the most model replicas the config can scale to), starts Serve's HTTP proxy on the config's host
and port (127.0.0.1 by default), deploys the application, and prints where it answers; each step of
the start is said as it happens, with its seconds (:class:`Progress`: a replica that loads for half a
minute is reminded of every 10 s, never silent). On exit
— Ctrl-C, SIGTERM or an error — it deletes the application (its replicas free their shards and
drafters) and stops Serve; a private Ray is shut down instead, Serve with it. Does not daemonise.

Two of Ray's lines would mislead on a clean run, so they are avoided where they arise: deploying
after ``serve.start`` logs that "new http_options ... will not be applied" (they were: ``serve.start``
applied them a moment before, in this process; that one record is dropped), and ``serve.shutdown``
reports its own controller's ``graceful_shutdown`` call as a failed task to be retried (the
controller kills itself while answering it); a private Ray, about to go, is not asked to.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from specserve.serve.app import MODEL, application
from specserve.serve.deploy_file import ServeFile

# Serve's note, when deploying after `serve.start`, that the options `serve.start` just applied "will not be applied".
HTTP_OPTIONS_KEPT = "New http_options/controller_options will not be applied"


def max_model_replicas(file: ServeFile) -> int:
    options = file.deployment_options.get(MODEL, {})
    autoscaling = options.get("autoscaling_config") or {}
    if autoscaling:
        return int(autoscaling.get("max_replicas", 1))
    replicas = options.get("num_replicas", 1)
    return int(replicas) if isinstance(replicas, int) else 1


class Progress:
    """Start-up lines with the seconds since the start (``say`` prints one), and while a long step runs, a line every
    ``every_s`` saying it still runs, so a start that takes half a minute is never silent."""

    def __init__(self, say: Callable[[str], None], every_s: float = 10.0) -> None:
        self.say = say
        self.every_s = every_s
        self.start = time.monotonic()

    def step(self, what: str) -> None:
        self.say(f"[{time.monotonic() - self.start:5.1f} s] {what}")

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """``what`` now, then "still ..." every ``every_s`` until the block ends."""
        self.step(what)
        done = threading.Event()

        def remind() -> None:
            while not done.wait(self.every_s):
                self.step(f"still {what.rstrip(' .')}")

        reminder = threading.Thread(target=remind, name="specserve-progress", daemon=True)
        reminder.start()
        try:
            yield
        finally:
            done.set()
            reminder.join()


@contextlib.contextmanager
def serving(
    file: ServeFile, ray_address: str | None = None, say: Callable[[str], None] | None = None
) -> Iterator[dict[str, Any]]:
    """The application deployed for the duration of the block; yields where it answers. ``say`` prints the start's
    steps (Ray, Serve's proxy, the deployment: the model replica loads the target and the drafter) with their
    seconds."""
    import ray
    from ray import serve

    from specserve.cluster.connect import PRIVATE_RAY, connect_ray

    config = file.config
    replicas = max_model_replicas(file)
    progress = Progress(say or (lambda _: None))
    with connect_ray(ray_address, tp_degree=config.tp_degree, spec=config.spec(), replicas=replicas) as where:
        progress.step(f"Ray: {where}")
        serve.start(http_options={"host": file.host, "port": file.port})
        progress.step(f"Serve's HTTP proxy on {file.host}:{file.port}")
        try:
            with (
                without_record(logging.getLogger("ray.serve"), HTTP_OPTIONS_KEPT),
                progress.waiting("deploying: the model replica loads the target and the drafter ..."),
            ):
                app = application(config, file.deployment_options)
                serve.run(app, name=file.app_name, route_prefix=file.route_prefix)
            progress.step("ready")
            base = f"http://{file.host}:{file.port}{file.route_prefix.rstrip('/')}"
            metrics_port = ray.nodes()[0].get("MetricsExportPort")
            yield {
                "url": f"{base}/v1",
                "health": f"{base}/health",
                "model": config.model_name,
                "ray": where,
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics" if metrics_port else None,
            }
        finally:
            with contextlib.suppress(Exception):
                serve.delete(file.app_name)
            if where != PRIVATE_RAY:  # a private Ray's shutdown, next, takes Serve with it
                serve.shutdown()


@contextlib.contextmanager
def without_record(logger: logging.Logger, words: str) -> Iterator[None]:
    """``logger`` drops the records whose message contains ``words`` for the duration of the block."""

    def keep(record: logging.LogRecord) -> bool:
        return words not in record.getMessage()

    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def wait_for_interrupt() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()

    def handle(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(0.5):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
