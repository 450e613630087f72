"""The one base class for errors a caller can fix: the message says what to change.

Front ends (CLI, HTTP) turn these into a one-line message or a 4xx response; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a missing model directory, an out-of-range parameter, an empty prompt..."""


class InvalidRequest(UserError):
    """The request cannot be served as given; the message says what to change."""


class ReplicaLost(RuntimeError):
    """A replica's target is gone (a shard died or froze): the request did not finish here, but may resume on a
    healthy replica from the tokens it already streamed (``specserve.core.resume``). Not the caller's fault."""
