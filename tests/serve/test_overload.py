"""Overload and slow or hostile bodies at the HTTP edge: body limits and deadlines, work off the event loop, timeouts.

First without Serve: the body reader (:mod:`specserve.serve.body`) over a fake ASGI ``receive``, and the
ingress's FastAPI app over a model replica held in process (as ``test_ingress_safety.py`` does) whose
tokenisation or generation is held up on purpose, so that what is checked is an ordering, never a
duration. Then through real Ray Serve and its proxy (uvicorn), raw sockets where a client library would
hide what the server does: a body shorter than its Content-Length and a body trickled a byte at a time get
408 and the connection is closed; a chunked body that grows past ``max_body_bytes`` gets 413 before the
client sent it all; ``/health`` answers while big prompts are being tokenised; a request that outlives
``request_timeout_s`` gets 504 (or, streaming, an error event and ``[DONE]``), its generation is cancelled
and its KV freed, and the server serves on.

Two applications, each with its own name and route prefix, deleted when the module ends: one with the
default request timeout (bodies, big prompts), one with a short one; both serve the tiny float64 llama pair
saved with a long context (so a request can outlive the timeout), batched in the replica's process (no
shard or drafter actors to start).
"""

from __future__ import annotations

import asyncio
import json
import select
import shutil
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import requests
from conftest import TinyPair
from serve_helpers import quick_shutdown
from starlette.requests import Request
from starlette.testclient import TestClient

from specserve.core.engine import SpeculativeEngine
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.app import MODEL, application
from specserve.serve.body import read_body
from specserve.serve.config import ServeConfig
from specserve.serve.errors import RequestError
from specserve.serve.ingress import OpenAIIngress
from specserve.serve.model_server import ModelServer
from specserve.serve.openai_api import OpenAIHandler, PreparedRequest

pytestmark = pytest.mark.timeout(600)

ERROR_KEYS = {"message", "type", "param", "code"}


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Polls ``condition`` until it holds; a bound on a wait, not an assertion about speed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------
# The body reader alone, over a fake ASGI receive


class FakeReceive:
    """An ASGI ``receive`` that hands out ``messages`` in order, then waits forever (a client that stopped sending)."""

    def __init__(self, messages: list[dict[str, Any]]) -> None:
        self.messages = messages
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls <= len(self.messages):
            return self.messages[self.calls - 1]
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def piece(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


def fake_request(receive: FakeReceive, headers: dict[str, str] | None = None) -> Request:
    raw = [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": raw}, receive)


def refusal(receive: FakeReceive, limit: int, timeout_s: float, headers: dict[str, str] | None = None) -> RequestError:
    with pytest.raises(RequestError) as refused:
        asyncio.run(read_body(fake_request(receive, headers), limit, timeout_s))
    assert refused.value.headers == {"Connection": "close"}
    return refused.value


def test_a_body_in_pieces_is_read_whole() -> None:
    receive = FakeReceive([piece(b'{"a": '), piece(b""), piece(b'"b"}', more=False)])
    assert asyncio.run(read_body(fake_request(receive), 1024, 10.0)) == b'{"a": "b"}'
    empty = FakeReceive([piece(b"", more=False)])
    assert asyncio.run(read_body(fake_request(empty), 1024, 10.0)) == b""


def test_a_growing_body_is_refused_once_past_the_limit_without_reading_the_rest() -> None:
    receive = FakeReceive([piece(b"x" * 400) for _ in range(100)])  # 40 000 bytes on offer, chunked
    error = refusal(receive, 1024, 10.0)
    assert error.status == 413 and "exceeds the limit of 1024" in error.message
    assert receive.calls == 3  # 400, 800, 1200: refused at the third piece, the other 97 never asked for


def test_a_declared_length_over_the_limit_is_refused_before_reading() -> None:
    receive = FakeReceive([piece(b"x" * 10, more=False)])
    error = refusal(receive, 1024, 10.0, {"Content-Length": "5000"})
    assert error.status == 413 and error.message == "request body of 5000 bytes exceeds the limit of 1024"
    assert receive.calls == 0


def test_a_body_that_stops_coming_is_refused_with_408() -> None:
    receive = FakeReceive([piece(b"x" * 10)])  # then nothing: shorter than it said, or very slow
    error = refusal(receive, 1024, 0.05, {"Content-Length": "1000"})
    assert (error.status, error.code) == (408, "body_timeout")
    assert "within 0.05 s (10 bytes came)" in error.message and "body_timeout_s" in error.message
    assert set(error.body()["error"]) == ERROR_KEYS


def test_a_client_gone_mid_body_is_a_400_not_a_failure() -> None:
    receive = FakeReceive([piece(b"x" * 10), {"type": "http.disconnect"}])
    error = refusal(receive, 1024, 10.0)
    assert error.status == 400 and "disconnected" in error.message


# ---------------------------------------------------------------------------------------------
# The ingress in process: tokenisation off the event loop, the request timeout


TINY = ServeConfig(model_name="tiny", gamma=3, default_max_tokens=8, max_num_seqs=1)  # the runner path
GOOD: dict[str, Any] = {"model": "tiny", "prompt": "abcab", "max_tokens": 6, "temperature": 0}


class HeldReplica:
    """A model replica in process whose generation, when ``hold`` is set, stops after its first chunk until closed;
    ``closed`` counts the generations closed before their end."""

    def __init__(self, server: ModelServer) -> None:
        self.server = server
        self.hold = False
        self.closed = 0

    def describe(self) -> PromptCodec:
        return self.server.describe()

    def started_at(self) -> int:
        return self.server.started_at()

    def check_health(self) -> None:
        self.server.check_health()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig
    ) -> AsyncIterator[StreamChunk]:
        finished = False
        try:
            async with aclosing(self.server.generate(prompt_ids, params, generation)) as chunks:
                async for chunk in chunks:
                    yield chunk
                    if self.hold:
                        await asyncio.Event().wait()  # a generation that outlives any timeout
            finished = True
        finally:
            if not finished:
                self.closed += 1


@pytest.fixture()
def replica(tiny_pairs: dict[str, TinyPair]) -> HeldReplica:
    pair = tiny_pairs["llama"]
    engine = SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))
    return HeldReplica(ModelServer(TINY, lambda config: engine))


def http(replica: HeldReplica, **settings: Any) -> TestClient:
    return TestClient(OpenAIIngress(TINY.model_copy(update=settings), replica).asgi(), raise_server_exceptions=False)


def test_requests_are_prepared_on_one_worker_thread_while_health_answers(
    replica: HeldReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request held in tokenisation does not hold the event loop: /health answers meanwhile; every request is
    prepared on the ingress's one worker thread."""
    prepare = OpenAIHandler.prepare
    release = threading.Event()
    threads: list[str] = []

    def held_prepare(handler: OpenAIHandler, request: Any, *tenant: str) -> PreparedRequest:
        threads.append(threading.current_thread().name)
        release.wait(60)  # the safety valve: never hang the session
        return prepare(handler, request, *tenant)

    monkeypatch.setattr(OpenAIHandler, "prepare", held_prepare)
    answers: list[int] = []
    with http(replica) as client:

        def send() -> None:
            answers.append(client.post("/v1/completions", json=GOOD).status_code)

        posts = [threading.Thread(target=send) for _ in range(2)]
        for post in posts:
            post.start()
        wait_for(lambda: len(threads) == 1, 60, "a request in tokenisation")
        health = client.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert answers == [] and len(threads) == 1  # answered while one request is held and the other waits its turn
        release.set()
        for post in posts:
            post.join(60)
    assert answers == [200, 200]
    assert len(threads) == 2 and len(set(threads)) == 1 and threads[0].startswith("specserve-prepare")


def test_a_request_past_its_timeout_is_a_504_and_its_generation_closed(replica: HeldReplica) -> None:
    replica.hold = True
    with http(replica, request_timeout_s=1.0) as client:
        answer = client.post("/v1/completions", json=GOOD)
        assert answer.status_code == 504, answer.text
        error = answer.json()["error"]
        assert set(error) == ERROR_KEYS and (error["type"], error["code"]) == ("server_error", "timeout")
        assert "within 1 s" in error["message"] and "request_timeout_s" in error["message"]
        assert replica.closed == 1
        replica.hold = False
        assert client.post("/v1/completions", json=GOOD).status_code == 200  # and the server keeps serving


def test_a_stream_past_its_timeout_ends_with_an_error_event_and_done(replica: HeldReplica) -> None:
    replica.hold = True
    with (
        http(replica, request_timeout_s=1.0) as client,
        client.stream("POST", "/v1/completions", json={**GOOD, "stream": True}) as answer,
    ):
        assert answer.status_code == 200  # the status line went before the time ran out
        lines = [line for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == ("timeout", "server_error") and "request_timeout_s" in error["message"]
    assert replica.closed == 1


# ---------------------------------------------------------------------------------------------
# Through Ray Serve's proxy


APP, APP_TIMEOUT = "overload", "overload-timeout"
PREFIX, PREFIX_TIMEOUT = "/overload", "/overload-timeout"
MODEL_NAME = "tiny-overload"
CONTEXT = 8192  # positions the saved pair's configs declare (rotary: any length works)
MAX_BODY = 2 << 20  # big enough that tokenising one body takes a while
BODY_TIMEOUT_S = 1.0
REQUEST_TIMEOUT_S = 2.0
AT_ONCE = 2


@pytest.fixture(scope="module")
def long_context_pair(saved_pairs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("overload-pair")
    for role in ("target", "draft"):
        shutil.copytree(saved_pairs["llama"] / role, root / role)
        path = root / role / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "max_position_embeddings": CONTEXT}))
    return root


def app_config(pair: Path, **settings: Any) -> ServeConfig:
    return ServeConfig(
        model_name=MODEL_NAME,
        target=str(pair / "target"),
        draft=str(pair / "draft"),
        dtype="float64",
        gamma=3,
        default_max_tokens=4,
        max_num_seqs=AT_ONCE,  # batched in the replica's process: no actors to start
        max_ongoing_requests=8,
        max_body_bytes=MAX_BODY,
        body_timeout_s=BODY_TIMEOUT_S,
        **settings,
    )


@pytest.fixture(scope="module")
def url(serve_url: str, long_context_pair: Path) -> Iterator[str]:
    from ray import serve

    serve.run(application(app_config(long_context_pair), quick_shutdown()), name=APP, route_prefix=PREFIX)
    yield serve_url + PREFIX
    serve.delete(APP)


@pytest.fixture(scope="module")
def timeout_url(serve_url: str, long_context_pair: Path) -> Iterator[str]:
    from ray import serve

    config = app_config(long_context_pair, request_timeout_s=REQUEST_TIMEOUT_S)
    serve.run(application(config, quick_shutdown()), name=APP_TIMEOUT, route_prefix=PREFIX_TIMEOUT)
    yield serve_url + PREFIX_TIMEOUT
    serve.delete(APP_TIMEOUT)


def post(url: str, body: dict[str, Any], **kwargs: Any) -> requests.Response:
    return requests.post(f"{url}/v1/completions", json=body, timeout=(10, 120), **kwargs)


def check_error(status: int, body: bytes, want_status: int, want_code: str | None) -> dict[str, Any]:
    error = json.loads(body)["error"]
    assert status == want_status, body
    assert set(error) == ERROR_KEYS and error["code"] == want_code and error["message"], error
    return dict(error)


# Raw HTTP/1.1 over a socket: what the proxy really does with the connection


def connect(url: str) -> tuple[socket.socket, str]:
    """A socket to the proxy, and the path of the completions route under ``url``."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=120)  # a hang fails, not blocks the run
    return sock, f"{parts.path}/v1/completions"


def head(path: str, *headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def readable(sock: socket.socket, wait_s: float) -> bool:
    return bool(select.select([sock], [], [], wait_s)[0])


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends, until it closes the connection (recv returns b"")."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    header, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = header.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert "content-length" in headers, header
    return int(status_line.split()[1]), headers, body[: int(headers["content-length"])]


def test_a_body_shorter_than_its_length_gets_408_and_the_connection_closed(url: str) -> None:
    sock, path = connect(url)
    with sock:
        sock.sendall(head(path, "Content-Length: 1000") + b'{"model": ')  # 10 of 1000 bytes, then nothing
        raw = read_to_close(sock)  # returns: the server closed the connection
    status, headers, body = parse(raw)
    error = check_error(status, body, 408, "body_timeout")
    assert f"within {BODY_TIMEOUT_S:g} s" in error["message"]
    assert headers["connection"] == "close"


def test_a_body_trickled_in_gets_408_and_the_connection_closed(url: str) -> None:
    sock, path = connect(url)
    with sock:
        sock.sendall(head(path, "Content-Length: 1000"))
        sent = 0
        while sent < 1000 and not readable(sock, 0.3):  # a byte every 0.3 s, until the server answers
            sock.sendall(b" ")
            sent += 1
        assert sent < 1000, "the server waited for the whole slow body"
        raw = read_to_close(sock)
    status, headers, body = parse(raw)
    check_error(status, body, 408, "body_timeout")
    assert headers["connection"] == "close"


def test_a_chunked_body_past_the_limit_gets_413_before_it_was_all_sent(url: str) -> None:
    def frame(data: bytes) -> bytes:  # one chunk of a chunked body
        return b"%x\r\n%s\r\n" % (len(data), data)

    piece = b" " * (64 << 10)
    sock, path = connect(url)
    with sock:
        sock.sendall(head(path, "Transfer-Encoding: chunked") + frame(b'{"model": "x", "prompt": "'))
        sent = 0
        while sent < 3 * MAX_BODY:  # the client would send far more (no final chunk ever comes)
            sock.sendall(frame(piece))
            sent += len(piece)
            # past the limit, give the answer time to come back before sending more (pacing, not an assertion)
            if readable(sock, 0.02 if sent <= MAX_BODY else 30):
                break
        assert sent < 3 * MAX_BODY, f"no answer after {sent} bytes of a body limited to {MAX_BODY}"
        raw = read_to_close(sock)
    status, headers, body = parse(raw)
    error = check_error(status, body, 413, None)
    assert f"exceeds the limit of {MAX_BODY}" in error["message"]
    assert headers["connection"] == "close"


def test_health_answers_while_big_prompts_are_tokenised(url: str) -> None:
    """Several bodies near ``max_body_bytes`` are tokenised one at a time on the ingress's worker thread (each is then
    refused: far longer than the context); /health answers in the meantime."""
    prompt = "abcab " * ((MAX_BODY - 200) // 6)
    answers: list[requests.Response] = []

    def send() -> None:
        answers.append(post(url, {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4}))

    posts = [threading.Thread(target=send) for _ in range(4)]
    for thread in posts:
        thread.start()
    try:
        wait_for(lambda: len(answers) >= 1, 300, "the first big prompt's answer")  # the others are in the server
        health = requests.get(f"{url}/health", timeout=60)
        answered_during_health = len(answers)
    finally:
        for thread in posts:
            thread.join(300)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert answered_during_health < len(posts), "/health was answered only once every big prompt was"
    assert len(answers) == len(posts)
    for answer in answers:
        check_error(answer.status_code, answer.content, 400, "context_length_exceeded")
    assert post(url, {"model": MODEL_NAME, "prompt": "abcab", "max_tokens": 4}).status_code == 200


# The request timeout


def model_status(app: str) -> dict[str, Any]:
    from ray import serve

    return dict(serve.get_deployment_handle(MODEL, app).status.remote().result(timeout_s=60))


def nothing_running(app: str) -> bool:
    status = model_status(app)
    return status["running"] == 0 and status["active_requests"] == [] and status["kv"]["free"] == status["kv"]["tokens"]


# far longer than the timeout: one token per target forward, EOS ignored, up to the context
ENDLESS: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "abcab",
    "max_tokens": CONTEXT - 16,
    "temperature": 0,
    "ignore_eos": True,
    "speculation": {"enabled": False},
}


def test_a_request_past_request_timeout_gets_504_and_is_cancelled(timeout_url: str) -> None:
    cancelled = model_status(APP_TIMEOUT)["finished"].get("cancelled", 0)
    answer = post(timeout_url, ENDLESS)
    error = check_error(answer.status_code, answer.content, 504, "timeout")
    assert error["type"] == "server_error" and f"within {REQUEST_TIMEOUT_S:g} s" in error["message"]
    assert "request_timeout_s" in error["message"]
    wait_for(lambda: model_status(APP_TIMEOUT)["finished"].get("cancelled", 0) == cancelled + 1, 60, "the cancel")
    wait_for(lambda: nothing_running(APP_TIMEOUT), 60, "the KV pool to empty")


def test_a_stream_past_request_timeout_ends_with_an_error_event_and_done(timeout_url: str) -> None:
    cancelled = model_status(APP_TIMEOUT)["finished"].get("cancelled", 0)
    with post(timeout_url, {**ENDLESS, "stream": True}, stream=True) as answer:
        assert answer.status_code == 200
        lines = [line.decode() for line in answer.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all("error" not in event for event in events[:-1]) and len(events) > 1  # text came, then the error
    error = events[-1]["error"]
    assert set(error) == ERROR_KEYS and (error["code"], error["type"]) == ("timeout", "server_error")
    wait_for(lambda: model_status(APP_TIMEOUT)["finished"].get("cancelled", 0) == cancelled + 1, 60, "the cancel")
    wait_for(lambda: nothing_running(APP_TIMEOUT), 60, "the KV pool to empty")


def test_the_server_serves_on_after_timeouts(timeout_url: str) -> None:
    answer = post(timeout_url, {**ENDLESS, "max_tokens": 8})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 8
    assert requests.get(f"{timeout_url}/health", timeout=60).status_code == 200
    wait_for(lambda: nothing_running(APP_TIMEOUT), 60, "the KV pool to empty")
