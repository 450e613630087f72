"""The gRPC wire end to end: a real VerifierServer on 127.0.0.1 around TargetVerifier, a drafter client over it.

Speculative decoding across the wire must produce exactly the single-process engine's tokens
(greedy and seeded sampling), and every kind of bad input ends only its own stream, with the
status code that names it, while the server keeps serving.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import grpc
import pytest
import torch
from conftest import VOCAB, TinyPair, hf_greedy_ids

from specserve.core.draft.drafter import Draft, Proposal, propose
from specserve.core.draft.schedule import Budget
from specserve.core.engine import SpeculativeEngine
from specserve.core.model.causal_lm import CausalLM
from specserve.core.request import GenerationConfig
from specserve.core.sampling.params import SamplingParams
from specserve.core.sampling.warps import make_generators
from specserve.core.target import CycleOutcome, LocalSequence, TargetVerifier
from specserve.core.verify.chain import TokenKind
from specserve.drafters.model import DraftModelDrafter
from specserve.rpc import codec
from specserve.rpc.gen import speculation_pb2 as pb
from specserve.rpc.verifier import (
    UnknownRequest,
    VerifierError,
    VerifierServer,
    VerifierStream,
    open_channel,
)

STREAM_TIMEOUT = 30.0  # a deadline on every call: a broken server fails the test instead of hanging it


class TargetBackend:
    """The target side of the wire: one TargetVerifier (its own KV cache) per started request."""

    def __init__(self, target: CausalLM) -> None:
        self.target = target
        self.vocab_size = target.info.vocab_size
        self._requests: dict[str, TargetVerifier] = {}
        self._lock = threading.Lock()

    def start(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, max_new_tokens: int) -> None:
        generators = make_generators(params.seed, self.target.device)  # .verify, as the engine uses it
        verifier = TargetVerifier(
            LocalSequence(self.target),
            prompt_ids,
            params,
            generators.verify,
            max_new_tokens,
            self.target.info.eos_token_ids,
            self.target.device,
        )
        verifier.prefill()
        with self._lock:
            self._requests[request_id] = verifier

    def verify(self, request_id: str, cycle: int, draft: Proposal) -> CycleOutcome:
        with self._lock:
            verifier = self._requests.get(request_id)
        if verifier is None:
            raise UnknownRequest(f"unknown request {request_id!r}")
        outcome = verifier.verify(draft)
        if outcome.finish is not None:  # a finished request is forgotten: later trees get NOT_FOUND
            with self._lock:
                del self._requests[request_id]
        return outcome


class ExplodingBackend(TargetBackend):
    """A backend with a bug for one request id."""

    def verify(self, request_id: str, cycle: int, draft: Proposal) -> CycleOutcome:
        if request_id == "boom":
            raise RuntimeError("backend bug")
        return super().verify(request_id, cycle, draft)


class Served:
    """A started server, its backend and a channel to it; ``stream()`` opens streams closed at teardown."""

    def __init__(
        self, backend: TargetBackend, max_message_bytes: int = codec.MAX_MESSAGE_BYTES, token: str | None = None
    ) -> None:
        self.backend = backend
        self.token = token
        self.server = VerifierServer(backend, max_message_bytes=max_message_bytes, token=token)
        self.address = self.server.start()
        self.channel = open_channel(self.address)
        self._streams: list[VerifierStream] = []

    def stream(self, token: str | None = None) -> VerifierStream:
        """A stream presenting ``token`` (default: the server's own, when it has one)."""
        stream = VerifierStream(self.channel, timeout=STREAM_TIMEOUT, token=token or self.token)
        self._streams.append(stream)
        return stream

    def close(self) -> None:
        for stream in self._streams:
            stream.close()
        self.channel.close()
        self.server.stop(0)


@pytest.fixture
def served(pair: TinyPair) -> Iterator[Served]:
    s = Served(TargetBackend(pair.target))
    yield s
    s.close()


@pytest.fixture
def llama(tiny_pairs: dict[str, TinyPair]) -> TinyPair:
    return tiny_pairs["llama"]


@pytest.fixture
def served_llama(llama: TinyPair) -> Iterator[Served]:
    s = Served(ExplodingBackend(llama.target))
    yield s
    s.close()


def generate_over_wire(
    served: Served,
    pair: TinyPair,
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    max_new_tokens: int,
    gamma: int,
    verdicts: list[codec.VerdictInfo] | None = None,
) -> list[int]:
    """The engine's loop with the verify step behind the wire (``verdicts`` collects what came back)."""
    generators = make_generators(params.seed)
    served.backend.start(request_id, prompt, params, max_new_tokens)
    drafter = DraftModelDrafter(pair.draft, pair.target)
    drafter.start(prompt, params, generators.draft)
    stream = served.stream()
    committed = len(prompt)
    output: list[int] = []
    for cycle in range(max_new_tokens + 1):
        draft = propose(drafter, Budget(gamma), max_new_tokens - len(output))
        assert draft.gamma == 0 or (draft.draft_probs is None) == params.greedy  # q travels when sampled
        stream.send(request_id, cycle, draft)
        info = stream.receive()
        if verdicts is not None:
            verdicts.append(info)
        assert (info.request_id, info.cycle) == (request_id, cycle)
        assert info.target_seconds > 0
        assert info.verdict.num_accepted <= draft.gamma
        new = info.outcome(draft, committed).new_tokens
        assert new == [*draft.tokens[: info.verdict.num_accepted].tolist(), info.verdict.next_token][: len(new)]
        committed = info.committed_length
        output.extend(new)
        if info.finish is not None:
            return output
        drafter.accept(new)
    raise AssertionError("the verifier never finished the request")


def engine_ids(
    pair: TinyPair, prompt: Sequence[int], params: SamplingParams, max_new_tokens: int, gamma: int
) -> list[int]:
    engine = SpeculativeEngine(pair.target, DraftModelDrafter(pair.draft, pair.target))
    result = engine.generate(list(prompt), params, GenerationConfig(max_new_tokens=max_new_tokens, gamma=gamma))
    return result.output_ids


# ---------------------------------------------------------------------------------------------
# Exactness across the wire


@pytest.mark.timeout(60)
def test_greedy_over_the_wire_equals_the_engine_and_transformers(served: Served, pair: TinyPair) -> None:
    params = SamplingParams()
    cases = [(pair.prompts[0], 1), (pair.prompts[3], 4), (pair.eos_prompts[0], 3), (pair.length_prompts[0], 5)]
    for i, (prompt, gamma) in enumerate(cases):
        wire = generate_over_wire(served, pair, f"greedy-{i}", prompt, params, 16, gamma)
        assert wire == engine_ids(pair, prompt, params, 16, gamma)
        assert wire == hf_greedy_ids(pair.target.model, prompt, 16)


@pytest.mark.timeout(60)
def test_sampling_over_the_wire_equals_the_engine(served: Served, pair: TinyPair) -> None:
    cases = [
        (pair.prompts[0], 2, SamplingParams(temperature=1.0, seed=3)),
        (pair.prompts[4], 4, SamplingParams(temperature=0.7, top_k=20, seed=11)),
        (pair.eos_prompts[1], 3, SamplingParams(temperature=0.9, top_p=0.9, seed=7)),
    ]
    verdicts: list[codec.VerdictInfo] = []
    for i, (prompt, gamma, params) in enumerate(cases):
        wire = generate_over_wire(served, pair, f"sampled-{i}", prompt, params, 16, gamma, verdicts)
        assert wire == engine_ids(pair, prompt, params, 16, gamma)
    # not vacuous: q decided both acceptances and rejections (recovered tokens drawn from the residual)
    assert any(v.verdict.num_accepted > 0 for v in verdicts)
    assert any(v.verdict.next_kind is TokenKind.RECOVERED for v in verdicts)
    # the seed matters: a different one gives a different continuation
    prompt, gamma, params = cases[0]
    other = SamplingParams(temperature=1.0, seed=4)
    assert generate_over_wire(served, pair, "other-seed", prompt, other, 16, gamma) != engine_ids(
        pair, prompt, params, 16, gamma
    )


@pytest.mark.timeout(60)
def test_concurrent_streams_do_not_interfere(served: Served, pair: TinyPair) -> None:
    params = SamplingParams(temperature=0.8, seed=5)
    prompts = [pair.prompts[0], pair.prompts[1], pair.prompts[2]]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = generate_over_wire(served, pair, f"concurrent-{i}", prompts[i], params, 12, 3)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    assert not errors, errors
    for i, prompt in enumerate(prompts):
        assert results[i] == engine_ids(pair, prompt, params, 12, 3)


# ---------------------------------------------------------------------------------------------
# Errors end one stream with the right status; the server keeps serving


def assert_serves(served: Served, request_id: str) -> None:
    """A fresh request on a fresh stream still gets verdicts."""
    served.backend.start(request_id, [5, 6, 7], SamplingParams(), 4)
    stream = served.stream()
    stream.send(request_id, 0, Draft(torch.tensor([8, 9]), None))
    info = stream.receive()
    assert info.request_id == request_id and info.committed_length == 3 + info.verdict.num_accepted + 1


def receive_error(stream: VerifierStream) -> VerifierError:
    with pytest.raises(VerifierError) as caught:
        stream.receive()
    return caught.value


@pytest.mark.timeout(60)
def test_server_binds_to_loopback(served_llama: Served) -> None:
    assert served_llama.address.startswith("127.0.0.1:")
    assert int(served_llama.address.rsplit(":", 1)[1]) > 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("garbage", [b"\xff\xff\xff", b"\x0a\x05ab", bytes(range(256))])
def test_malformed_bytes_give_invalid_argument(served_llama: Served, garbage: bytes) -> None:
    stream = served_llama.stream()
    stream.send_raw(garbage)
    error = receive_error(stream)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "malformed DraftTree" in str(error)
    assert_serves(served_llama, "after-garbage")


@pytest.mark.timeout(60)
def test_error_mid_stream_ends_that_stream_only(served_llama: Served) -> None:
    served_llama.backend.start("mid", [5, 6, 7], SamplingParams(), 8)
    stream = served_llama.stream()
    stream.send("mid", 0, Draft(torch.tensor([8]), None))
    assert stream.receive().cycle == 0
    stream.send_raw(pb.DraftTree(request_id="mid", cycle=1, token_ids=[1, 2], parents=[-1]).SerializeToString())
    error = receive_error(stream)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "parents" in str(error)
    assert_serves(served_llama, "after-mid")


@pytest.mark.timeout(60)
def test_unknown_request_gives_not_found(served_llama: Served) -> None:
    stream = served_llama.stream()
    stream.send("never-started", 0, Draft(torch.tensor([3]), None))
    error = receive_error(stream)
    assert error.code == grpc.StatusCode.NOT_FOUND and "never-started" in str(error)
    assert_serves(served_llama, "after-unknown")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("token", [VOCAB, 2**31 - 1, -1])
def test_out_of_vocabulary_draft_gives_invalid_argument(served_llama: Served, llama: TinyPair, token: int) -> None:
    assert llama.target.info.vocab_size == VOCAB
    served_llama.backend.start("oov", [5, 6, 7], SamplingParams(), 8)
    stream = served_llama.stream()
    stream.send_raw(
        pb.DraftTree(request_id="oov", token_ids=[4, token], parents=[-1, 0], rules=pb.RULES_CHAIN).SerializeToString()
    )
    error = receive_error(stream)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in str(error)
    assert_serves(served_llama, "after-oov")


@pytest.mark.timeout(60)
def test_oversize_message_gives_resource_exhausted(llama: TinyPair) -> None:
    served = Served(TargetBackend(llama.target), max_message_bytes=2048)
    try:
        served.backend.start("big", [5, 6, 7], SamplingParams(temperature=1.0), 8)
        q = torch.full((4, VOCAB), 1 / VOCAB, dtype=torch.float64)  # full support: ~1 KiB per node on the wire
        draft = Draft(torch.tensor([4, 5, 6, 7]), q)
        assert codec.encode_draft("big", 0, draft).ByteSize() > 2048
        stream = served.stream()
        stream.send("big", 0, draft)
        assert receive_error(stream).code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert_serves(served, "after-big")
    finally:
        served.close()


@pytest.mark.timeout(60)
def test_backend_bug_gives_internal(served_llama: Served) -> None:
    served_llama.backend.start("boom", [5, 6, 7], SamplingParams(), 8)
    stream = served_llama.stream()
    stream.send("boom", 0, Draft(torch.tensor([4]), None))
    error = receive_error(stream)
    assert error.code == grpc.StatusCode.INTERNAL and "RuntimeError: backend bug" in str(error)
    assert_serves(served_llama, "after-boom")


@pytest.mark.timeout(60)
def test_tree_after_the_request_finished_gives_not_found(served_llama: Served) -> None:
    served_llama.backend.start("short", [5, 6, 7], SamplingParams(), 1)
    stream = served_llama.stream()
    stream.send("short", 0, Draft.empty())
    info = stream.receive()
    assert info.finish == "length" and info.committed_length == 4
    stream.send("short", 1, Draft.empty())
    assert receive_error(stream).code == grpc.StatusCode.NOT_FOUND
    assert_serves(served_llama, "after-short")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("presented", [None, "", "wrong-secret", "s3cret-but-longer"])
def test_a_verifier_with_a_token_refuses_streams_without_it(llama: TinyPair, presented: str | None) -> None:
    """A replica's verifier serves its own drafters only: a stream without the secret, or with another, ends with
    UNAUTHENTICATED before any draft is verified; the right secret is served."""
    served = Served(TargetBackend(llama.target), token="s3cret")
    try:
        served.backend.start("guarded", [5, 6, 7], SamplingParams(), 4)
        stream = VerifierStream(served.channel, timeout=STREAM_TIMEOUT, token=presented)
        stream.send("guarded", 0, Draft(torch.tensor([8, 9]), None))
        error = receive_error(stream)
        stream.close()
        assert error.code == grpc.StatusCode.UNAUTHENTICATED
        assert list(served.backend._requests["guarded"].committed) == [5, 6, 7]  # nothing was verified
        assert_serves(served, "with-the-token")
    finally:
        served.close()
