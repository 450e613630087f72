"""``specserve serve``: the application on a local (or given) Ray cluster, until Ctrl-C.

Joins Ray as every command that spawns replicas does (:func:`~specserve.cluster.connect.connect_ray`:
``--ray-address``, the ``specserve cluster up`` cluster, or a private Ray on 127.0.0.1 sized for
the most model replicas the config can scale to), starts Serve's HTTP proxy on the config's host
and port (127.0.0.1 by default), deploys the application, and prints where it answers. On exit
— Ctrl-C, SIGTERM or an error — it deletes the application (its replicas free their shards and
drafters) and stops Serve; a private Ray is shut down too. Does not daemonise.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from specserve.serve.app import MODEL, application
from specserve.serve.deploy_file import ServeFile


def max_model_replicas(file: ServeFile) -> int:
    options = file.deployment_options.get(MODEL, {})
    autoscaling = options.get("autoscaling_config") or {}
    if autoscaling:
        return int(autoscaling.get("max_replicas", 1))
    replicas = options.get("num_replicas", 1)
    return int(replicas) if isinstance(replicas, int) else 1


@contextlib.contextmanager
def serving(file: ServeFile, ray_address: str | None = None) -> Iterator[dict[str, Any]]:
    """The application deployed for the duration of the block; yields where it answers."""
    import ray
    from ray import serve

    from specserve.cluster.connect import connect_ray

    config = file.config
    replicas = max_model_replicas(file)
    with connect_ray(ray_address, tp_degree=config.tp_degree, spec=config.spec(), replicas=replicas) as where:
        serve.start(http_options={"host": file.host, "port": file.port})
        try:
            serve.run(application(config, file.deployment_options), name=file.app_name, route_prefix=file.route_prefix)
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
            serve.shutdown()


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
