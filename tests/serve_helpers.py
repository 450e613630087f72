"""Serve applications in tests (no fixtures, importable from any module): deployed without waiting, shut down quickly.

A Serve application's start keeps about one core busy at a time (its replicas' processes importing torch and loading
weights, one after the other), and most serving tests leave the other core idle: a module that needs a second
application deploys it without waiting, as soon as its first one runs, and waits for it only when its tests begin.

A replica Serve stops (``serve.delete``, a downscale) drains first: it sleeps ``graceful_shutdown_wait_loop_s``
(Serve's default 2 s) before it first looks for requests in flight, even when it has none. The tests' applications
look every 0.1 s instead (:func:`quick_shutdown`): the same drain, up to the same ``graceful_shutdown_timeout_s``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

SHUTDOWN_WAIT_LOOP_S = 0.1


def quick_shutdown(options: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``deployment_options`` for :func:`specserve.serve.app.application`: ``options`` (per deployment), and each
    deployment's replicas looking for requests in flight every :data:`SHUTDOWN_WAIT_LOOP_S` as they stop."""
    from specserve.serve.app import DEPLOYMENTS

    options = options or {}
    return {
        name: {"graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_LOOP_S, **options.get(name, {})} for name in DEPLOYMENTS
    }


def deploy_without_waiting(app: Any, name: str, route_prefix: str) -> None:
    """Hands the application ``app`` (an ``Application``) to Serve's controller and returns at once."""
    from ray import serve

    target = serve.RunTarget(app, name=name, route_prefix=route_prefix)
    serve.run_many([target], wait_for_ingress_deployment_creation=False, wait_for_applications_running=False)


def wait_until_running(name: str, timeout_s: float = 600.0) -> None:
    """Until Serve says the application ``name`` runs (it fails at once when its deployment failed)."""
    from ray import serve

    deadline = time.monotonic() + timeout_s
    while (status := serve.status().applications[name]).status != "RUNNING":
        assert status.status in ("NOT_STARTED", "DEPLOYING"), status
        assert time.monotonic() < deadline, f"{name} is not running after {timeout_s:g} s: {status}"
        time.sleep(0.5)
