"""The ``specserve.v1.Verifier`` gRPC service: a server around a verification backend, and a client stream.

``Speculate`` is one bidirectional stream per request: the drafter writes ``DraftTree`` messages
and reads one ``Verdict`` per tree. Handlers are registered with grpc's generic API and move raw
bytes, so every message is parsed (and validated) by :mod:`specserve.rpc.codec`; nothing
received is unpickled. Message-size limits are set explicitly on both ends
(:data:`~specserve.rpc.codec.MAX_MESSAGE_BYTES`); a malformed tree ends the stream with
``INVALID_ARGUMENT``, an unknown request with ``NOT_FOUND``, and the server keeps serving.

The server binds to 127.0.0.1 unless told otherwise. Given a ``token`` (a replica's rank 0 makes one
per replica), it serves only streams whose metadata carries it (:data:`TOKEN_KEY`, compared in
constant time); any other stream ends at once with ``UNAUTHENTICATED``, before a message is read.
What verification means is the backend's business (:class:`VerifierBackend`, which returns the
core :class:`~specserve.core.target.CycleOutcome`); this module only carries messages, and only
:mod:`specserve.rpc` encodes protobuf.
"""

from __future__ import annotations

import functools
import hmac
import logging
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import grpc

from specserve.core.draft.drafter import Proposal
from specserve.core.errors import UserError
from specserve.core.target import CycleOutcome
from specserve.rpc.codec import (
    MAX_MESSAGE_BYTES,
    VerdictInfo,
    WireError,
    encode_draft,
    encode_verdict,
    parse_draft,
    parse_verdict,
)

logger = logging.getLogger(__name__)

SERVICE = "specserve.v1.Verifier"
SPECULATE = f"/{SERVICE}/Speculate"
TOKEN_KEY = "x-specserve-verifier-token"  # the stream metadata that carries the replica's secret


def grpc_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes), ("grpc.max_receive_message_length", max_message_bytes)]


class UnknownRequest(UserError):
    """A tree names a request the target has not been told about (or has already finished)."""


class VerifierError(RuntimeError):
    """The verifier ended the stream with an error status; the message carries its details. Never the HTTP client's
    fault (drafts are the replica's own), so not a ``UserError``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"verifier returned {code.name}: {details}")
        self.code = code
        self.details = details

    def __reduce__(self) -> tuple[Any, ...]:  # crosses Ray by pickle: rebuild from both arguments
        return (type(self), (self.code, self.details))


class VerifierBackend(Protocol):
    """What the server needs from the target: the vocabulary size and one verify step."""

    @property
    def vocab_size(self) -> int: ...

    def verify(self, request_id: str, cycle: int, proposal: Proposal) -> CycleOutcome:
        """Verify one chain or tree of a known request (the core outcome; this module encodes it); raise
        :class:`UnknownRequest` for any other."""
        ...


class VerifierServer:
    """A gRPC server exposing one backend on ``host:port`` (port 0 = any free port)."""

    def __init__(
        self,
        backend: VerifierBackend,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 16,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        run_in: Callable[[Callable[[], bytes]], bytes] | None = None,
        token: str | None = None,
    ) -> None:
        """``run_in`` runs each message's decode + verify + encode somewhere else than the gRPC
        handler thread (an actor passes its compute thread); by default it runs in place. With ``token``, only
        streams that present it are served."""
        self.backend = backend
        self._token = token
        self._run_in = run_in or (lambda fn: fn())
        executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="verifier")
        self._server = grpc.server(executor, options=grpc_options(max_message_bytes))
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {"Speculate": grpc.stream_stream_rpc_method_handler(self._speculate)}
        )
        self._server.add_generic_rpc_handlers((handler,))
        bound = self._server.add_insecure_port(f"{host}:{port}")
        if bound == 0:
            raise UserError(f"could not bind the verifier to {host}:{port}; is the port in use?")
        self.address = f"{host}:{bound}"

    def start(self) -> str:
        self._server.start()
        return self.address

    def stop(self, grace: float | None = 1.0) -> None:
        self._server.stop(grace).wait()

    def _speculate(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        if self._token is not None and not self._authentic(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this verifier serves its replica's drafters only")
        for data in requests:
            try:
                reply = self._run_in(functools.partial(self._handle, data))
            except WireError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except UnknownRequest as exc:
                context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except UserError as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except Exception as exc:  # a bug must end this stream, not the server
                logger.exception("verification failed")
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            yield reply

    def _authentic(self, context: grpc.ServicerContext) -> bool:
        assert self._token is not None
        presented = dict(context.invocation_metadata()).get(TOKEN_KEY, "")
        return isinstance(presented, str) and hmac.compare_digest(presented.encode(), self._token.encode())

    def _handle(self, data: bytes) -> bytes:
        request_id, cycle, proposal = parse_draft(data, self.backend.vocab_size)
        outcome = self.backend.verify(request_id, cycle, proposal)
        return bytes(encode_verdict(request_id, cycle, outcome).SerializeToString())


_END = object()


class VerifierStream:
    """Client side of one ``Speculate`` stream: ``send`` a tree, ``receive`` its verdict, in turn.

    Sending does not wait for the verdict, so a drafter can keep drafting while the target
    verifies (overlap mode) and collect the verdict afterwards.
    """

    def __init__(self, channel: grpc.Channel, timeout: float | None = None, token: str | None = None) -> None:
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        call = channel.stream_stream(SPECULATE)
        metadata = ((TOKEN_KEY, token),) if token else None
        self._call = call(iter(self._outbox.get, _END), timeout=timeout, metadata=metadata)

    def send(self, request_id: str, cycle: int, proposal: Proposal) -> None:
        self.send_raw(encode_draft(request_id, cycle, proposal).SerializeToString())

    def send_raw(self, data: bytes) -> None:
        self._outbox.put(data)

    def receive(self) -> VerdictInfo:
        try:
            data = next(self._call)
        except grpc.RpcError as exc:
            raise VerifierError(exc.code(), exc.details() or "") from exc
        except StopIteration:
            raise VerifierError(grpc.StatusCode.UNAVAILABLE, "the verifier closed the stream") from None
        return parse_verdict(data)

    def close(self) -> None:
        self._outbox.put(_END)
        self._call.cancel()


def open_channel(address: str) -> grpc.Channel:
    """An insecure channel with our message-size limits (loopback or a trusted cluster network)."""
    return grpc.insecure_channel(address, options=grpc_options())
