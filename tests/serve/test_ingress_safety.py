"""The ingress's safety, without Serve: its FastAPI app over a model replica held in process.

The replica is a :class:`ModelServer` over the in-process engine on the tiny llama pair, wrapped so
that its generation or health check can be made to fail. Checks: a failure inside generation tells
the client only a request id (no exception text, traceback, path, process id or ANSI code, in a 500
or in a stream's error event) and logs the exception under that id; POST bodies must be
``application/json`` (415 otherwise; the official ``openai`` client is unaffected); the API docs
follow ``api_docs`` and sit behind the API key; ``/ready`` checks a replica on every probe, within a
timeout, and turns back when the replica recovers. Also: a private Ray (``connect_ray``) is started
loopback-only — by the options it passes, and, when this session's Ray is such a one, by what its
processes listen on.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import openai
import pytest
from conftest import TinyPair
from starlette.testclient import TestClient

from specserve.core.engine import SpeculativeEngine
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.ingress import OpenAIIngress
from specserve.serve.model_server import ModelServer

KEY = "sk-safety"
CONFIG = ServeConfig(model_name="tiny", gamma=3, default_max_tokens=8, max_num_seqs=1)  # the runner path
GOOD: dict[str, Any] = {"model": "tiny", "prompt": "abcab", "max_tokens": 6, "temperature": 0}
JSON = {"Content-Type": "application/json"}
# What a real failure's text carries (a colored Ray traceback names files, processes and addresses): none of it may
# reach a client.
SECRET = "\x1b[31mshard died\x1b[0m in /work/secret/coordinator.py (pid=4242, ip=10.1.2.3)"
LEAKS = ("shard died", "/work/secret", "pid=4242", "10.1.2.3", "\x1b", "\\u001b", "Traceback", "RuntimeError")
INTERNAL = re.compile(r"internal error \(request id (req-[0-9a-f]{32})\); see the server log")


class Replica:
    """A model replica in process whose generation fails after ``fail_after`` chunks (or after its last, when the
    engine merged its chunks into fewer for a slow reader), or whose health check fails (``broken``) or hangs until
    ``release`` is set (``hangs``)."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server
        self.fail_after: int | None = None
        self.broken = False
        self.hangs = False
        self.release = threading.Event()

    def describe(self) -> PromptCodec:
        return self.server.describe()

    def started_at(self) -> int:
        return self.server.started_at()

    def check_health(self) -> None:
        if self.hangs:
            self.release.wait(30)
        if self.broken:
            raise RuntimeError(SECRET)
        self.server.check_health()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig
    ) -> AsyncIterator[StreamChunk]:
        async with aclosing(self.server.generate(prompt_ids, params, generation)) as chunks:
            sent = 0
            async for chunk in chunks:
                if sent == self.fail_after:
                    raise RuntimeError(SECRET)
                yield chunk
                sent += 1
        if self.fail_after is not None:  # a slow reader gets merged chunks (fewer of them): fail after the last
            raise RuntimeError(SECRET)


@pytest.fixture()
def replica(tiny_pairs: dict[str, TinyPair]) -> Replica:
    pair = tiny_pairs["llama"]
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    return Replica(ModelServer(CONFIG, lambda config: engine))


def http(replica: Replica, ready_timeout_s: float = 5.0, **settings: Any) -> TestClient:
    ingress = OpenAIIngress(CONFIG.model_copy(update=settings), replica, ready_timeout_s=ready_timeout_s)
    # the app answers unexpected exceptions itself; Starlette then re-raises them for the server to log
    return TestClient(ingress.asgi(), raise_server_exceptions=False)


@pytest.fixture()
def server_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Records of the ``ray.serve`` logger (the replica's log in Serve), whether or not Serve stops its propagation."""
    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="ray.serve")
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)


def logged_with(log: pytest.LogCaptureFixture, request_id: str) -> list[logging.LogRecord]:
    return [record for record in log.records if request_id in record.getMessage()]


def assert_nothing_leaks(text: str) -> None:
    leaked = [leak for leak in LEAKS if leak in text]
    assert not leaked, f"{leaked} reached the client: {text!r}"


# ---------------------------------------------------------------------------------------------
# Failures inside generation


@pytest.mark.parametrize("fail_after", [0, 2], ids=["before-the-first-chunk", "mid-generation"])
def test_a_failure_tells_the_client_only_a_request_id(
    replica: Replica, server_log: pytest.LogCaptureFixture, fail_after: int
) -> None:
    replica.fail_after = fail_after
    ids = []
    with http(replica) as client:
        for _ in range(2):
            answer = client.post("/v1/completions", json=GOOD)
            assert answer.status_code == 500, answer.text
            assert_nothing_leaks(answer.text)
            error = answer.json()["error"]
            match = INTERNAL.fullmatch(error["message"])
            assert match, error
            assert (error["type"], error["code"], error["param"]) == ("server_error", "internal_error", None)
            ids.append(match.group(1))
        # the whole exception is in the server log, under the id the client was given
        for request_id in ids:
            (record,) = logged_with(server_log, request_id)
            assert record.levelno == logging.ERROR and record.exc_info is not None
            assert SECRET in str(record.exc_info[1])
        assert ids[0] != ids[1]
        replica.fail_after = None
        assert client.post("/v1/completions", json=GOOD).status_code == 200  # and the server keeps serving


def test_a_failure_mid_stream_is_an_event_with_only_a_request_id(
    replica: Replica, server_log: pytest.LogCaptureFixture
) -> None:
    replica.fail_after = 2
    with http(replica) as client, client.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as answer:
        assert answer.status_code == 200  # the status line went before the failure
        lines = [line for line in answer.iter_lines() if line]
    assert_nothing_leaks("\n".join(lines))
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert "error" not in events[0] and "error" in events[-1]
    match = INTERNAL.fullmatch(events[-1]["error"]["message"])
    assert match, events[-1]
    (record,) = logged_with(server_log, match.group(1))
    assert record.exc_info is not None and SECRET in str(record.exc_info[1])


def test_an_unexpected_failure_outside_generation_is_a_short_500(
    replica: Replica, server_log: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    def describe() -> PromptCodec:
        raise RuntimeError(SECRET)

    monkeypatch.setattr(replica, "describe", describe)
    with http(replica) as client:
        answer = client.get("/v1/models")
    assert answer.status_code == 500
    assert_nothing_leaks(answer.text)
    match = INTERNAL.fullmatch(answer.json()["error"]["message"])
    assert match and logged_with(server_log, match.group(1))


# ---------------------------------------------------------------------------------------------
# Content-Type


NOT_JSON = [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data", "application/jsonx"]


@pytest.mark.parametrize("content_type", NOT_JSON)
def test_post_bodies_must_be_json(replica: Replica, content_type: str | None) -> None:
    headers = {"Content-Type": content_type} if content_type else {}
    with http(replica) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            answer = client.post(path, content=json.dumps(GOOD).encode(), headers=headers)
            assert answer.status_code == 415, answer.text
            error = answer.json()["error"]
            assert "Content-Type: application/json" in error["message"] and error["code"] == "unsupported_media_type"
            assert error["type"] == "invalid_request_error" and error["param"] is None


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_json_with_or_without_a_charset_is_taken(replica: Replica, content_type: str) -> None:
    with http(replica) as client:
        body = json.dumps(GOOD).encode()
        answer = client.post("/v1/completions", content=body, headers={"Content-Type": content_type})
    assert answer.status_code == 200, answer.text


def test_the_key_is_asked_before_the_content_type(replica: Replica) -> None:
    with http(replica, api_key=KEY) as client:
        answer = client.post("/v1/completions", content=b"x", headers={"Content-Type": "text/plain"})
    assert answer.status_code == 401


def test_the_openai_client_sends_json(replica: Replica) -> None:
    with http(replica, api_key=KEY) as client:
        api = openai.OpenAI(base_url=f"{client.base_url}/v1", api_key=KEY, http_client=client, max_retries=0)
        answer = api.completions.create(model="tiny", prompt="abcab", max_tokens=4, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens > 0
        chat = api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
        )
        assert chat.choices[0].message.role == "assistant"


# ---------------------------------------------------------------------------------------------
# API docs


DOCS = ("/docs", "/redoc", "/openapi.json")


def test_docs_are_served_without_a_key_by_default(replica: Replica) -> None:
    with http(replica) as client:
        for path in DOCS:
            assert client.get(path).status_code == 200, path
        assert "/v1/completions" in client.get("/openapi.json").json()["paths"]


def test_docs_are_off_by_default_when_a_key_is_set(replica: Replica) -> None:
    with http(replica, api_key=KEY) as client:
        for path in DOCS:
            answer = client.get(path, headers={"Authorization": f"Bearer {KEY}"})
            assert answer.status_code == 404 and "error" in answer.json(), path


def test_docs_asked_for_sit_behind_the_key(replica: Replica) -> None:
    with http(replica, api_key=KEY, api_docs="on") as client:
        for path in DOCS:
            assert client.get(path).status_code == 401, path
            assert client.get(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401, path
            assert client.get(path, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200, path


def test_docs_can_be_turned_off(replica: Replica) -> None:
    with http(replica, api_docs="off") as client:
        for path in DOCS:
            assert client.get(path).status_code == 404, path


# ---------------------------------------------------------------------------------------------
# Readiness


def test_ready_checks_a_replica_on_every_probe(replica: Replica, server_log: pytest.LogCaptureFixture) -> None:
    with http(replica) as client:
        ready = client.get("/ready")
        assert ready.status_code == 200 and ready.json() == {"status": "ready", "model": "tiny"}
        replica.broken = True  # after a success: nothing remembered
        broken = client.get("/ready")
        assert broken.status_code == 503 and broken.json()["status"] == "not ready"
        assert_nothing_leaks(broken.text)
        request_id = re.search(r"req-[0-9a-f]{32}", broken.json()["reason"])
        assert request_id and logged_with(server_log, request_id.group(0))
        assert client.get("/health").status_code == 200  # liveness: the ingress answers
        replica.broken = False  # recovered
        assert client.get("/ready").status_code == 200


def test_ready_gives_up_after_its_timeout(replica: Replica) -> None:
    replica.hangs = True
    try:
        with http(replica, ready_timeout_s=0.2) as client:
            answer = client.get("/ready")
            assert answer.status_code == 503 and "within 0.2 s" in answer.json()["reason"]
            replica.release.set()
            replica.hangs = False
            assert client.get("/ready").status_code == 200
    finally:
        replica.release.set()


# ---------------------------------------------------------------------------------------------
# A private Ray listens on loopback only


def test_a_private_ray_is_started_loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray
    from ray._private import ray_constants

    from specserve.cluster import connect, processes

    seen: dict[str, Any] = {}

    def init(**options: Any) -> None:  # what ray.init would see
        seen.update(options, env=os.environ.get(connect.SINGLE_MACHINE_ENV), cluster=ray_constants.ENABLE_RAY_CLUSTER)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(processes, "connect_address", lambda: None)
    monkeypatch.setattr(connect, "choose_token_auth", lambda: None)  # this session's Ray keeps its own auth mode
    monkeypatch.delenv(connect.SINGLE_MACHINE_ENV, raising=False)
    before = ray_constants.ENABLE_RAY_CLUSTER
    with connect.connect_ray() as where:
        assert where == connect.PRIVATE_RAY
    assert seen["env"] == "0" and seen["cluster"] is False  # Ray keeps 127.0.0.1 as the node's address
    assert seen["_node_ip_address"] == "127.0.0.1" and seen["dashboard_host"] == "127.0.0.1"
    assert seen["include_dashboard"] is False
    assert connect.SINGLE_MACHINE_ENV not in os.environ and before == ray_constants.ENABLE_RAY_CLUSTER  # restored


def beyond_loopback(pids: set[int]) -> list[str]:
    """The listening TCP sockets of these processes that accept connections from other machines."""
    import psutil  # Ray's own copy

    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in pids:
            continue
        address = ipaddress.ip_address(conn.laddr.ip)
        mapped = getattr(address, "ipv4_mapped", None)
        if not (mapped or address).is_loopback:
            out.append(f"{psutil.Process(conn.pid).name()} (pid {conn.pid}) on {conn.laddr.ip}:{conn.laddr.port}")
    return out


def test_the_private_rays_processes_listen_on_loopback_only(ray_cluster: Any) -> None:
    """The session's Ray, started loopback-only as ``connect_ray`` starts a private one (tests/conftest.py): none of
    its processes (this driver and its descendants) listens beyond loopback."""
    import psutil

    node = ray_cluster.nodes()[0]["NodeManagerAddress"]
    assert ipaddress.ip_address(node).is_loopback, f"the session's Ray took the node address {node}"
    me = psutil.Process()
    pids = {me.pid, *(child.pid for child in me.children(recursive=True))}
    assert beyond_loopback(pids) == []
