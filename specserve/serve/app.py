"""The Ray Serve application: ``serve.deployment`` applied to the plain classes, in one builder.

Two deployments, as in Ray Serve LLM's design:

* ``OpenAIIngress`` (:mod:`specserve.serve.ingress`) — the HTTP routes; light, one replica is
  plenty;
* ``ModelServer`` (:mod:`specserve.serve.model_server`) — one target replica each; this is the
  deployment that Serve's autoscaling grows and shrinks with load. On the distributed runtime its
  TP shards and drafter are Ray actors it places when it starts, so the replica itself asks Ray for
  no CPU; batched in process (``ReplicaConfig.batches_in_process``) it runs the target itself, so it
  asks for what a shard would: ``cpus_per_shard`` CPUs, one unit of ``large_resource`` and, on cuda,
  a GPU.

:func:`build_app` is the ``import_path`` of ``deploy/serve.yaml``: Ray's ``serve run`` /
``serve deploy`` call it with the YAML's ``args``, which are :class:`ServeConfig` one to one;
per-deployment settings (``autoscaling_config``, ``max_ongoing_requests``...) come from the
YAML's ``deployments`` list as Serve applies them. :func:`application` takes the same options
in code (the ``specserve serve`` command and the tests use it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application

from specserve.serve.config import ServeConfig
from specserve.serve.ingress import OpenAIIngress
from specserve.serve.model_server import ModelServer, build_runner

# How often Serve checks a model replica. A replica that lost a shard fails its check at once and Serve replaces it;
# until then it refuses requests at once and the ingress resumes them elsewhere (the check is a few actor pings).
HEALTH_CHECK_PERIOD_S = 2
INGRESS = "OpenAIIngress"
MODEL = "ModelServer"
DEPLOYMENTS = (INGRESS, MODEL)


def build_app(args: Mapping[str, Any] | None = None) -> Application:
    """Serve's application builder: ``args`` are the Serve config YAML's, validated by :class:`ServeConfig`."""
    settings = dict(args or {})
    return application(ServeConfig.model_validate(settings).with_suggested_gamma("gamma" in settings))


def application(config: ServeConfig, deployment_options: Mapping[str, Mapping[str, Any]] | None = None) -> Application:
    """The application for ``config``; ``deployment_options`` maps a deployment name to ``.options()`` overrides."""
    options = dict(deployment_options or {})
    unknown = set(options) - set(DEPLOYMENTS)
    if unknown:
        raise ValueError(f"unknown deployment(s) {sorted(unknown)}; this application has {list(DEPLOYMENTS)}")
    args = config.model_dump()
    model = serve.deployment(
        name=MODEL,
        ray_actor_options=model_actor_options(config),
        max_ongoing_requests=config.ongoing_requests,
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        health_check_timeout_s=60,
        graceful_shutdown_timeout_s=30,
    )(ModelServer).options(**options.get(MODEL, {}))
    ingress = serve.deployment(
        name=INGRESS,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=1024,  # the ingress only forwards; the model replicas' queues bound the work
    )(serve.ingress()(OpenAIIngress)).options(**options.get(INGRESS, {}))
    return ingress.bind(args, model.bind(args, build_runner, True, True))  # metrics; end a lost replica's actor


def model_actor_options(config: ServeConfig) -> dict[str, Any]:
    """What one ModelServer replica asks Ray for: nothing when the compute lives in the actors it places; a
    shard's share when it runs the batched engine in its own process."""
    if not config.batches_in_process:
        return {"num_cpus": 0}
    options: dict[str, Any] = {"num_cpus": config.cpus_per_shard, "resources": {config.large_resource: 1.0}}
    if config.device.startswith("cuda"):
        options["num_gpus"] = 1
    return options
