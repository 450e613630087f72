"""Chaos end to end: real Ray Serve on 127.0.0.1, a model replica killed mid-stream, the stream goes on exactly.

One application whose single ModelServer replica batches in process (the tiny float64 llama pair with a
2048-token context). A client streams a long request; after a few events the replica's actor is killed
(``ray.kill``: its process, engine and KV are gone). Serve starts a new replica, and the ingress resumes
the request there from what the client already has: the client's text equals an undisturbed run's, greedy
and with drafter-invariant sampling, with no error event — it saw a pause, nothing else.

Then a TP 2 application on the distributed runtime (target shards and drafter as Ray actors): rank 1's process is
killed while two streams run. The replica fails fast (``ReplicaLost``), ``/ready`` says 503 while it is broken,
Serve replaces it, and both streams complete with their undisturbed text.
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


# ---------------------------------------------------------------------------------------------
# A target shard killed: the distributed runtime at TP 2


TP_APP = "chaos-tp"


@pytest.fixture(scope="module")
def tp_url(url: str, long_context_pair: Path) -> Iterator[str]:
    from ray import serve

    serve.delete(APP)  # one application at a time on the session's cluster
    config = ServeConfig(
        model_name=MODEL_NAME,
        target=str(long_context_pair / "target"),
        draft=str(long_context_pair / "draft"),
        dtype="float64",
        gamma=3,
        tp_degree=2,
        max_num_seqs=2,
        max_seq_len=1024,
        max_ongoing_requests=4,
        stall_timeout_s=5.0,
    )
    serve.run(application(config), name=TP_APP, route_prefix="/")
    yield url
    serve.delete(TP_APP)


def replica_processes(app: str) -> dict[str, Any]:
    from ray import serve

    status: dict[str, Any] = serve.get_deployment_handle(MODEL, app_name=app).status.remote().result()
    return dict(status["processes"])


def test_a_killed_shards_streams_resume_exactly_and_ready_says_so(tp_url: str) -> None:
    """Two streams (greedy, drafter-invariant sampling) on a TP 2 replica; rank 1's process is killed after a few
    events: /ready turns 503 while the replica is broken, and both streams complete with their undisturbed text."""
    import os
    import signal
    import threading

    bodies = [{**BODY, **sampling} for sampling in SAMPLINGS.values()]
    answers = [requests.post(f"{tp_url}/v1/completions", json=body, timeout=300).json() for body in bodies]
    wants = [answer["choices"][0]["text"] for answer in answers]
    shard = replica_processes(TP_APP)["shards"][1]
    results: dict[int, tuple[str, list[Any], int]] = {}
    started = threading.Barrier(len(bodies) + 1)

    def client(index: int) -> None:
        started.wait()
        results[index] = stream(tp_url, bodies[index])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    started.wait()
    time.sleep(1.0)  # both streams are running (each takes well over this undisturbed)
    os.kill(shard, signal.SIGKILL)
    assert not results  # neither stream had finished
    deadline = time.monotonic() + 60
    while requests.get(f"{tp_url}/ready", timeout=30).status_code == 200:
        assert time.monotonic() < deadline, "/ready never reported the broken replica"
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=300)
    for index, want in enumerate(wants):
        text, errors, tokens = results[index]
        assert errors == [] and text == want and tokens == 900
    wait_until_ready(tp_url)
    assert replica_processes(TP_APP)["shards"][1] != shard  # a new replica finished them
