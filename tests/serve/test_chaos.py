"""Chaos end to end: real Ray Serve on 127.0.0.1, a model replica killed mid-stream, the stream goes on exactly.

One application whose single ModelServer replica batches in process (the tiny float64 llama pair with a
2048-token context). Two clients stream a long request each, one greedy, one with drafter-invariant sampling; once
both have had a few events the replica's actor is killed (``ray.kill``: its process, engine and KV are gone). Serve
starts a new replica, and the ingress resumes both requests there from what each client already has: each client's
text equals an undisturbed run's, with no error event — it saw a pause, nothing else.

Then a TP 2 application on the distributed runtime (target shards as Ray actors, drafting on a member of the model's
shared drafter pool): rank 1's process is killed while the same two streams run. The replica fails fast
(``ReplicaLost``), ``/ready`` says 503 while it is broken, Serve replaces it — the new replica joins the same pool —
and both streams complete with their undisturbed text.

The undisturbed texts are each request's whole answer, generated alone, once, by the first application: greedy and
drafter-invariant sampling emit the same tokens whatever the runtime (in process or distributed at TP 2, batched or
not: tests/actors), so they are what either application must stream.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from serve_helpers import deploy_without_waiting, quick_shutdown, wait_until_running

from specserve.actors.drafter_pool import SharedPool
from specserve.serve.app import MODEL, application
from specserve.serve.config import ServeConfig

pytestmark = pytest.mark.timeout(600)

APP, TP_APP = "chaos", "chaos-tp"
TP_PREFIX = "/tp"
MODEL_NAME = "tiny-chaos"
BODY: dict[str, Any] = {"model": MODEL_NAME, "prompt": "abcabcabc", "max_tokens": 900, "ignore_eos": True}


def app_config(pair: Path, **settings: Any) -> ServeConfig:
    return ServeConfig(
        model_name=MODEL_NAME,
        target=str(pair / "target"),
        draft=str(pair / "draft"),
        dtype="float64",
        gamma=3,
        max_num_seqs=2,
        max_seq_len=1024,
        max_ongoing_requests=4,
        **settings,
    )


def tp_config(pair: Path) -> ServeConfig:
    return app_config(pair, tp_degree=2, stall_timeout_s=5.0, drafter_placement="pool")


@pytest.fixture(scope="module")
def url(serve_url: str, long_context_pair: Path) -> Iterator[str]:
    """The application batching in process; once it runs, the TP 2 one (``tp_url``) starts deploying beside it, its
    actors starting while the tests of this one run."""
    from ray import serve

    serve.run(application(app_config(long_context_pair), quick_shutdown()), name=APP, route_prefix="/")
    deploy_without_waiting(application(tp_config(long_context_pair), quick_shutdown()), TP_APP, TP_PREFIX)
    yield serve_url
    serve.delete(APP)
    serve.delete(TP_APP)


def model_replica() -> tuple[str, Any]:
    """The name and handle of the application's (one) live ModelServer replica actor."""
    import ray

    actors = ray.util.list_named_actors(all_namespaces=True)
    # Serve names a replica's actor SERVE_REPLICA::<application>#<deployment>#<id>
    named = [actor for actor in actors if f"::{APP}#{MODEL}#" in actor["name"]]
    assert len(named) == 1, named
    return named[0]["name"], ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])


def stream(
    url: str, body: dict[str, Any], after_event: Callable[[int], None] | None = None
) -> tuple[str, list[Any], int]:
    """An SSE completion: its text, its error events, and its completion tokens; calls ``after_event(n)`` after the
    n-th text event."""
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
            if after_event is not None:
                after_event(events)
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
BODIES = [{**BODY, **sampling} for sampling in SAMPLINGS.values()]


@pytest.fixture(scope="module")
def undisturbed(url: str) -> list[str]:
    """Each body's whole answer, generated alone (its completion tokens checked): the text its stream must have."""
    texts = []
    for body in BODIES:
        answer = requests.post(f"{url}/v1/completions", json=body, timeout=300).json()
        assert answer["usage"]["completion_tokens"] == 900, answer
        texts.append(answer["choices"][0]["text"])
    return texts


def streams_in_threads(url: str, after_event: Callable[[int], None] | None = None) -> list[threading.Thread]:
    """Starts one client thread per body (its result lands in ``RESULTS[index]``)."""
    RESULTS.clear()

    def client(index: int) -> None:
        RESULTS[index] = stream(url, BODIES[index], after_event)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(BODIES))]
    for thread in threads:
        thread.start()
    return threads


RESULTS: dict[int, tuple[str, list[Any], int]] = {}


def test_a_killed_model_replicas_streams_resume_exactly(url: str, undisturbed: list[str]) -> None:
    """Both streams (greedy, drafter-invariant sampling) are running, three events in each, when the replica's actor
    is killed; a new replica finishes both with their undisturbed text."""
    import ray

    before, replica = model_replica()
    # the last stream to reach its third event kills the replica, the other one waiting meanwhile: both are mid-stream
    both_streaming = threading.Barrier(len(BODIES), action=lambda: ray.kill(replica, no_restart=True))

    def after_event(events: int) -> None:
        if events == 3:
            both_streaming.wait(timeout=300)

    for thread in streams_in_threads(url, after_event):
        thread.join(timeout=600)
    for index, want in enumerate(undisturbed):
        text, errors, tokens = RESULTS[index]
        assert errors == [] and text == want and tokens == 900, index
    wait_until_ready(url)
    assert model_replica()[0] != before  # a new replica finished them


# ---------------------------------------------------------------------------------------------
# A target shard killed: the distributed runtime at TP 2


@pytest.fixture(scope="module")
def tp_url(url: str, undisturbed: list[str], long_context_pair: Path) -> Iterator[str]:
    """The TP 2 application (deploying since ``url`` ran), once it runs, alone on the session's cluster."""
    from ray import serve

    serve.delete(APP)  # the undisturbed texts are known
    wait_until_running(TP_APP)
    yield url + TP_PREFIX
    serve.delete(TP_APP)
    SharedPool(tp_config(long_context_pair)).shutdown()  # now, not once idle for its downscale delay


def replica_status(app: str) -> dict[str, Any]:
    from ray import serve

    status: dict[str, Any] = serve.get_deployment_handle(MODEL, app_name=app).status.remote().result()
    return status


def replica_processes(app: str) -> dict[str, Any]:
    return dict(replica_status(app)["processes"])


def test_a_killed_shards_streams_resume_exactly_and_ready_says_so(tp_url: str, undisturbed: list[str]) -> None:
    """Two streams (greedy, drafter-invariant sampling) on a TP 2 replica; rank 1's process is killed after a few
    events: /ready turns 503 while the replica is broken, and both streams complete with their undisturbed text. The
    new replica drafts on the pool member the lost one drafted on."""
    import os
    import signal

    before = replica_processes(TP_APP)
    shard = before["shards"][1]
    streaming = threading.Barrier(len(BODIES) + 1)

    def after_event(events: int) -> None:
        if events == 1:
            streaming.wait(timeout=300)

    threads = streams_in_threads(tp_url, after_event)
    streaming.wait(timeout=300)  # both streams have had their first event
    time.sleep(1.0)  # both streams are running (each takes well over this undisturbed)
    os.kill(shard, signal.SIGKILL)
    assert not RESULTS  # neither stream had finished
    deadline = time.monotonic() + 60
    while requests.get(f"{tp_url}/ready", timeout=30).status_code == 200:
        assert time.monotonic() < deadline, "/ready never reported the broken replica"
        time.sleep(0.05)
    for thread in threads:
        thread.join(timeout=300)
    for index, want in enumerate(undisturbed):
        text, errors, tokens = RESULTS[index]
        assert errors == [] and text == want and tokens == 900, index
    wait_until_ready(tp_url)
    after = replica_processes(TP_APP)
    assert after["shards"][1] != shard  # a new replica finished them
    assert after["drafter"] == before["drafter"]  # on the shared pool's member, which outlived the lost replica
    pool = replica_status(TP_APP)["drafter_pool"]
    assert pool["replicas"] >= 1 and [state for state, _ in pool["members"]] == ["ready"]
