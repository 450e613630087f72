"""The one base class for errors a caller can fix: the message says what to change.

Front ends (CLI, HTTP) turn these into a one-line message or a 4xx response; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class UserError(ValueError):
    """Bad input: a missing model directory, an out-of-range parameter, an empty prompt..."""


class InvalidRequest(UserError):
    """The request cannot be served as given; the message says what to change."""


class ReplicaLost(RuntimeError):
    """A replica's target is gone (a shard died or froze): the request did not finish here, but may resume on a
    healthy replica from the tokens it already streamed (``specserve.core.resume``). Not the caller's fault."""


class RequestFailed(RuntimeError):
    """One request's own failure in a batched step (its drafter or its processors raised, or the target's logits for
    its rows were not finite): that request ended, every other request of the step went on. Not the caller's fault;
    the message names no internals (the server log keeps the cause)."""


class GrammarFailed(InvalidRequest):
    """The request's grammar compiled but could not run: llguidance's lexer or parser gave up on it mid-generation
    (a budget it ran out of). The caller's to fix: a simpler grammar."""


def request_failure(exc: Exception, what: str) -> Exception:
    """What ends one request of a batched step whose own ``what`` (its drafting, its verdict...) raised ``exc``: a
    :class:`UserError` as it is (its grammar could not run: the caller's to fix); anything else logged here with its
    traceback and reported as :class:`RequestFailed`, whose message names nothing internal."""
    if isinstance(exc, UserError):
        return exc
    logger.error("%s failed for one request of a batched step; the others go on", what, exc_info=exc)
    failure = RequestFailed(f"{what} failed for this request; the other requests of its batch went on")
    failure.__cause__ = exc
    return failure
