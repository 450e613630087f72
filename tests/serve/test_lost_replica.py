"""A request whose replica is lost resumes on a healthy one, without Serve: the ingress over two replicas in process.

Replica A loses its target (``ReplicaLost``, as a coordinator raises when a shard dies) after a few chunks;
the ingress sends the request again with what the client already has, and replica B continues it. The client
sees one answer equal to an undisturbed run — whole or streamed, greedy or drafter-invariant sampling — with no
error event; the lost replica fails its health check and refuses new requests at once. With no healthy replica
left the client gets a 503 with ``Retry-After`` (or an error event) once ``resume_timeout_s`` has passed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

import pytest
from conftest import TinyPair
from starlette.testclient import TestClient

from specserve.core.engine import GenerationFrontend, SpeculativeEngine
from specserve.core.errors import ReplicaLost
from specserve.core.prompts import PromptCodec
from specserve.core.request import GenerationConfig, StreamChunk
from specserve.core.resume import Resume
from specserve.core.sampling.params import SamplingParams
from specserve.drafters.registry import build_drafter_set
from specserve.serve.config import ServeConfig
from specserve.serve.ingress import OpenAIIngress
from specserve.serve.model_server import ModelServer

CONFIG = ServeConfig(model_name="tiny", gamma=3, resume_timeout_s=1.0, max_num_seqs=1)  # the runner path
JSON = {"Content-Type": "application/json"}


class LosingEngine(GenerationFrontend):
    """The engine, until it has streamed ``lose_after`` chunks of one request: then its target is lost."""

    def __init__(self, engine: SpeculativeEngine, lose_after: int) -> None:
        self.engine = engine
        self.prompts = engine.prompts
        self.lose_after = lose_after

    def _run(self, prompt_ids: list[int], params: SamplingParams, config: GenerationConfig) -> Iterator[StreamChunk]:
        for sent, chunk in enumerate(self.engine._run(prompt_ids, params, config)):
            if sent == self.lose_after:
                raise ReplicaLost("rank 1 died (test)")
            yield chunk


class Fleet:
    """Two model replicas behind one backend; a request goes to the first that has not lost its target (as Serve's
    router stops sending to a replica that failed its health check)."""

    def __init__(self, *servers: ModelServer) -> None:
        self.servers = servers
        self.resumes: list[Resume | None] = []

    def _healthy(self) -> ModelServer:
        return next((s for s in self.servers if s.lost is None), self.servers[0])

    def describe(self) -> PromptCodec:
        return self.servers[-1].describe()

    def started_at(self) -> int:
        return self.servers[-1].started_at()

    def check_health(self) -> None:
        self._healthy().check_health()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, generation: GenerationConfig, resume: Resume | None = None
    ) -> AsyncIterator[StreamChunk]:
        self.resumes.append(resume)
        async with aclosing(self._healthy().generate(prompt_ids, params, generation, resume)) as chunks:
            async for chunk in chunks:
                yield chunk


@pytest.fixture()
def engine(tiny_pairs: dict[str, TinyPair]) -> SpeculativeEngine:
    pair = tiny_pairs["llama"]
    return SpeculativeEngine(pair.target, build_drafter_set(pair.draft, pair.target))


def fleet(engine: SpeculativeEngine, lose_after: int = 3, healthy: bool = True) -> Fleet:
    lost = ModelServer(CONFIG, lambda config: LosingEngine(engine, lose_after))
    return Fleet(lost, ModelServer(CONFIG, lambda config: engine)) if healthy else Fleet(lost)


def http(backend: Any) -> TestClient:
    return TestClient(OpenAIIngress(CONFIG, backend).asgi(), raise_server_exceptions=False)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": "abcab", "max_tokens": 30, "ignore_eos": True, **extra}


def streamed(client: TestClient, request: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """The text of an SSE answer, and its error events."""
    text, errors = "", []
    with client.stream("POST", "/v1/completions", json={**request, "stream": True}, headers=JSON) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                errors.append(event["error"])
            else:
                text += event["choices"][0]["text"]
    return text, errors


SAMPLINGS = {
    "greedy": {"temperature": 0},
    "drafter-invariant": {"temperature": 0.9, "seed": 3, "speculation": {"drafter_invariant": True}},
}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_a_lost_replicas_request_resumes_exactly(engine: SpeculativeEngine, sampling: dict[str, Any]) -> None:
    want = http(fleet(engine, healthy=True).servers[1]).post("/v1/completions", json=body(**sampling)).json()
    backend = fleet(engine)
    answer = http(backend).post("/v1/completions", json=body(**sampling))
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["choices"][0]["finish_reason"] == "length"
    assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"] == 30
    first, then = backend.resumes
    assert first is None and then is not None and len(then.output_ids) > 0  # it broke mid-request, and resumed

    backend = fleet(engine)
    text, errors = streamed(http(backend), body(**sampling))
    assert errors == [] and text == want["choices"][0]["text"]
    assert backend.resumes[1] is not None


def test_a_lost_replica_fails_fast_afterwards(engine: SpeculativeEngine) -> None:
    backend = fleet(engine)
    assert http(backend).post("/v1/completions", json=body()).status_code == 200
    lost = backend.servers[0]
    with pytest.raises(ReplicaLost):
        lost.check_health()

    async def one_more() -> None:
        async for _ in lost.generate([5, 6], SamplingParams(), GenerationConfig(max_new_tokens=2)):
            pass

    import asyncio

    with pytest.raises(ReplicaLost, match="serves no more requests"):
        asyncio.run(one_more())
    assert lost.status()["finished"] == {"error": 1}  # the refused one was never taken


def test_with_no_healthy_replica_the_client_is_told_to_retry(engine: SpeculativeEngine) -> None:
    client = http(fleet(engine, healthy=False))
    answer = client.post("/v1/completions", json=body())
    assert answer.status_code == 503, answer.text
    assert answer.headers["Retry-After"].isdigit()
    assert answer.json()["error"]["code"] == "replica_unavailable"
    assert client.get("/ready").status_code == 503  # the only replica is broken

    client = http(fleet(engine, healthy=False))
    text, errors = streamed(client, body())
    assert [e["code"] for e in errors] == ["replica_unavailable"] and text  # the tokens before the loss arrived
