"""The HTTP edge's refusals: :class:`RequestError`, OpenAI's error JSON with its status, and the words it says.

A refusal is a :class:`RequestError`: a message, a status (4xx, or 5xx for the server's own failures), the field
at fault and a code; :meth:`RequestError.body` is OpenAI's shape (``{"error": {"message", "type", "param",
"code"}}``, the ``type`` chosen by status). Its message names the field in the client's words: pydantic's first
error phrased as what to fix (:meth:`RequestError.from_validation`, :func:`error_words`: without pydantic's
``Value error, `` prefix, an undeclared field as :data:`UNKNOWN_FIELD`), every fault inside an object of a tagged
union reported at that object (:func:`tagged_union_error`), and the engine's names of request fields
(``max_new_tokens``) replaced by the OpenAI ones the client sent (:func:`openai_words`). :data:`STRICT` is the
validation every request object shares (JSON's own types, an integer being a number; finite numbers; no undeclared
field), whose faults these words phrase. Does not: declare a request field or its bounds
(:mod:`specserve.serve.schemas`, :mod:`specserve.serve.speculation_schema`), decide which status a failure below the
edge gets (:mod:`specserve.serve.ingress`), or send the answer.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from specserve.cluster.replica_config import validator_words

# JSON's own types (an integer is also a number), finite numbers, no field that is not declared.
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


ERROR_TYPES = {  # OpenAI's error ``type`` by status (anything else: invalid_request_error below 500)
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class RequestError(Exception):
    """A request the server refuses; ``body()`` is the OpenAI-style error JSON."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.headers = dict(headers or {})  # extra response headers (429: Retry-After)

    def body(self) -> dict[str, Any]:
        kind = ERROR_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    @classmethod
    def from_validation(cls, exc: ValidationError) -> RequestError:
        """The first field pydantic found wrong, phrased as what to fix.

        A value that fits no member of a union (``prompt: 5``) fails once per member, at
        ``prompt.str``, ``prompt.list[int]``...: those are reported together, at the field.
        """
        errors = exc.errors()
        field = errors[0]["loc"][:1]
        same_field = [error for error in errors if error["loc"][:1] == field]
        loc = _common_prefix([tuple(error["loc"]) for error in same_field])
        param = ".".join(str(part) for part in loc) or None
        reasons = " or ".join(dict.fromkeys(error_words(error) for error in same_field))
        if not loc and errors[0]["type"] == "model_type":  # a JSON array, string, number or null
            reasons = "the request body must be a JSON object"
        message = f"{param}: {reasons}" if param else reasons
        return cls(message, status=400, param=param, code="invalid_value")

    @classmethod
    def from_user_error(cls, exc: Exception, status: int = 400, **fields: Any) -> RequestError:
        """A :class:`~specserve.core.errors.UserError` from below the HTTP edge, in the words of the API the client
        speaks (:func:`openai_words`)."""
        return cls(openai_words(str(exc)), status=status, **fields)


# The engine's names for what the client sent under OpenAI's names (the engine's errors name its own fields).
OPENAI_NAMES = {"max_new_tokens": "max_tokens"}


def openai_words(message: str) -> str:
    """``message`` with the engine's names of request fields replaced by the ones the client sent."""
    for ours, theirs in OPENAI_NAMES.items():
        message = re.sub(rf"\b{ours}\b", theirs, message)
    return message


UNKNOWN_FIELD = "unknown field: this route takes the OpenAI fields and extensions listed in docs/usage.md"


def error_words(error: Any) -> str:
    """One pydantic error (an ``ErrorDetails``) as the client is told it."""
    if error["type"] == "extra_forbidden":
        return UNKNOWN_FIELD
    return validator_words(str(error["msg"]))


def _common_prefix(locs: list[tuple[Any, ...]]) -> tuple[Any, ...]:
    prefix = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(prefix), len(loc)) and prefix[n] == loc[n]:
            n += 1
        prefix = prefix[:n]
    return prefix


def tagged_union_error(exc: ValidationError, tag: str, tags: tuple[str, ...]) -> PydanticCustomError:
    """Every fault inside an object of a tagged union as one error at the object, each inner field named in the
    message without the union's tag (pydantic's locations contain it, and it is no key of the JSON)."""
    reasons = []
    for error in exc.errors():
        loc = error["loc"][1:] if error["loc"][:1] and error["loc"][0] in tags else error["loc"]
        where = ".".join(str(part) for part in loc)
        reason = error_words(error)
        if error["type"] in ("union_tag_invalid", "union_tag_not_found"):
            where = tag
            reason = "Input should be " + ", ".join(repr(t) for t in tags[:-1]) + f" or {tags[-1]!r}"
        reasons.append(f"{where}: {reason}" if where else reason)
    return PydanticCustomError("invalid_object", "{reasons}", {"reasons": "; ".join(dict.fromkeys(reasons))})
