"""A request body read as it arrives: at most ``max_bytes``, and the whole of it within ``timeout_s``.

:func:`read_body` is how the ingress (:mod:`specserve.serve.ingress`) reads a ``POST`` body. It
refuses, with OpenAI's error JSON (a :class:`~specserve.serve.errors.RequestError`):

* a declared ``Content-Length`` over ``max_bytes``: 413 before any of the body is read;
* a body that grows past ``max_bytes`` as it streams (chunked, or longer than it said): 413 the
  moment the count passes the limit, without reading the rest;
* a body that has not arrived whole within ``timeout_s`` of the first read (shorter than its
  ``Content-Length``, or trickled a byte at a time): 408;
* a client that went away mid-body: 400 (nobody reads it; it keeps the server log clean).

Each refusal carries ``Connection: close``: the rest of the body is never read, so the connection
cannot carry another request and the HTTP server (uvicorn, in Serve's proxy) drops it after the
answer.

Does not: bound what Serve's proxy buffers on the way (the proxy reads the client's socket as fast
as it comes and queues it for the replica, see ``docs/security.md``), bound the time before the
headers arrive (uvicorn's), parse or validate the JSON (:func:`~specserve.serve.schemas.parse_request`).
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing

from starlette.requests import ClientDisconnect, Request

from specserve.serve.errors import RequestError

CLOSE = {"Connection": "close"}  # the unread rest of the body makes the connection unusable


def too_large(size: int | str, limit: int) -> RequestError:
    return RequestError(f"request body of {size} bytes exceeds the limit of {limit}", status=413, headers=CLOSE)


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body of ``request``, or a :class:`RequestError` (413, 408, 400; with ``Connection: close``)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large(declared, max_bytes)
    chunks: list[bytes] = []
    size = 0
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline, aclosing(request.stream()) as stream:
            async for chunk in stream:
                size += len(chunk)
                if size > max_bytes:
                    raise too_large(f"more than {max_bytes}", max_bytes)
                chunks.append(chunk)
    except TimeoutError:
        if not deadline.expired():  # not ours: something below timed out
            raise
        raise RequestError(
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came): send the whole body at "
            "once (the server's `body_timeout_s`)",
            status=408,
            code="body_timeout",
            headers=CLOSE,
        ) from None
    except ClientDisconnect:
        raise RequestError("the client disconnected before sending its whole body", headers=CLOSE) from None
    return b"".join(chunks)
