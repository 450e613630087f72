"""Chaos end to end: real Ray Serve on 127.0.0.1, a model replica killed mid-stream, the stream goes on exactly.

One application whose single ModelServer replica batches in process (the tiny float64 llama pair with a
2048-token context). A client streams a long request; after a few events the replica's actor is killed
(``ray.kill``: its process, engine and KV are gone). Serve starts a new replica, and the ingress resumes
the request there from what the client already has: the client's text equals an undisturbed run's, greedy
and with drafter-invariant sampling, with no error event — it saw a pause, nothing else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from specserve.serve.app import MODEL, application
from specserve.serve.config import ServeConfig

pytestmark = pytest.mark.timeout(600)

APP = "chaos"
MODEL_NAME = "tiny-chaos"
BODY: dict[str, Any] = {"model": MODEL_NAME, "prompt": "abcabcabc", "max_tokens": 900, "ignore_eos": True}


@pytest.fixture(scope="module")
def url(serve_url: str, long_context_pair: Path) -> Iterator[str]:
    from ray import serve

    config = ServeConfig(
        model_name=MODEL_NAME,
        target=str(long_context_pair / "target"),
        draft=str(long_context_pair / "draft"),
        dtype="float64",
        gamma=3,
        max_num_seqs=2,
        max_seq_len=1024,
        max_ongoing_requests=4,
    )
    serve.run(application(config), name=APP, route_prefix="/")
    yield serve_url
    serve.delete(APP)


def model_replica() -> tuple[str, Any]:
    """The name and handle of the application's (one) live ModelServer replica actor."""
    import ray

    named = [
        actor
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if APP in actor["name"] and MODEL in actor["name"]
    ]
    assert len(named) == 1, named
    return named[0]["name"], ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])


def stream(url: str, body: dict[str, Any], kill_after: int | None = None) -> tuple[str, list[Any], int]:
    """An SSE completion: its text, its error events, and its completion tokens; kills the model replica after
    ``kill_after`` text events."""
    import ray

    text, errors, tokens, events = "", [], 0, 0
    with requests.post(f"{url}/v1/completions", json={**body, "stream": True}, stream=True, timeout=300) as answer:
        assert answer.status_code == 200, answer.text
        for line in answer.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[len(b"data: ") :])
            if "error" in event:
                errors.append(event["error"])
                continue
            text += event["choices"][0]["text"]
            tokens = event.get("usage", {}).get("completion_tokens", tokens)
            events += 1
            if events == kill_after:
                ray.kill(model_replica()[1], no_restart=True)
    return text, errors, tokens


def wait_until_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while requests.get(f"{url}/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "no model replica became ready"
        time.sleep(0.5)


SAMPLINGS = {
    "greedy": {"temperature": 0},
    "drafter-invariant": {"temperature": 0.8, "seed": 5, "speculation": {"drafter_invariant": True}},
}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_killed_model_replicas_stream_resumes_exactly(url: str, sampling: dict[str, Any]) -> None:
    body = {**BODY, **sampling}
    want = requests.post(f"{url}/v1/completions", json=body, timeout=300).json()
    before, _ = model_replica()
    text, errors, tokens = stream(url, body, kill_after=3)
    assert errors == []
    assert text == want["choices"][0]["text"] and tokens == want["usage"]["completion_tokens"] == 900
    wait_until_ready(url)
    assert model_replica()[0] != before  # a new replica finished it
