"""Ray Serve endpoints: the OpenAI-compatible HTTP API in front of the distributed runtime.

``config`` (ServeConfig) and ``schemas`` validate at the edge; ``openai_api`` shapes OpenAI
answers; ``ingress`` (HTTP) and ``model_server`` (one target replica) are plain classes that
``app`` turns into Serve deployments; ``metrics`` exports Prometheus metrics through Ray;
``deploy_file`` reads Serve config YAML; ``launch`` runs ``specserve serve``.
"""
