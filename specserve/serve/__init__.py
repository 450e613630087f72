"""Ray Serve endpoints: the OpenAI-compatible HTTP API in front of the distributed runtime.

``config`` (ServeConfig: the replica configuration plus the serving settings) and ``schemas`` (the
OpenAI request bodies, with ``speculation_schema``: the ``speculation`` extension) validate at the
edge, and ``errors`` is what the edge refuses with (OpenAI's error JSON); ``openai_api`` shapes
OpenAI answers; ``ingress`` (HTTP) and ``model_server`` (one target replica: batched in process on
``engine_loop``'s thread, or on the distributed runtime) are plain classes that ``app`` turns into
Serve deployments; ``metrics`` exports Prometheus metrics through Ray; ``deploy_file`` reads Serve
config YAML; ``launch`` serves it on Ray until Ctrl-C; ``command`` is the ``specserve serve``
subcommand (its arguments and entry point, registered in :mod:`specserve.cli`).
"""
