"""Ray Serve endpoints: the OpenAI-compatible HTTP API in front of the distributed runtime (issue 4, in progress)."""
