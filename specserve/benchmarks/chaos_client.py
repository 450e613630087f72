"""The load client of ``specserve bench-chaos``: streamed greedy completions, each recorded as its client saw it.

:func:`reference_texts` asks once per prompt, undisturbed and not streamed, for the text every soak request on that
prompt must match; :func:`stream_into` streams one completion into a :class:`StreamRecord` (the send time, each text
event's arrival and text, the HTTP status, any error event, the final ``completion_tokens``) and, once told to stop,
cuts it at its next line. A record also answers the questions the analysis asks of one request (completed, failed
or unfinished; its pauses; in flight or streaming at a moment: :mod:`specserve.benchmarks.chaos` defines each).
Every call has a timeout (a stream may pause ``READ_TIMEOUT_S`` at most). Does not: run the clients' closed loop or
time the soak (:func:`specserve.benchmarks.chaos.soak`), kill anything (:mod:`specserve.benchmarks.chaos_kill`), or
judge what the records show (:mod:`specserve.benchmarks.chaos_report`).
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import requests
from tqdm import tqdm

CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # the longest a stream may pause: beyond the ingress's resume_timeout_s (60 s by default)
REFERENCE_TIMEOUT_S = 300.0  # a reference request (the first one pays for lazy initialisation)


@dataclass
class StreamRecord:
    """What one client saw of one request; times are seconds since the soak started."""

    client: int
    prompt: int  # index into the prompts
    sent: float
    events: list[tuple[float, str]] = field(default_factory=list)  # (arrival, text) of each event carrying text
    status: int | None = None
    error: str | None = None  # an error event, a non-200 answer, a transport error, a stream that ended early
    error_event: bool = False  # the stream carried an error event
    tokens: int | None = None  # completion_tokens of the final event
    ended: float | None = None  # None: still running when the soak was cut
    cut: bool = False  # stopped at the drain limit

    @property
    def text(self) -> str:
        return "".join(text for _, text in self.events)

    @property
    def first(self) -> float | None:
        return self.events[0][0] if self.events else None

    @property
    def unfinished(self) -> bool:
        return self.cut or self.ended is None

    @property
    def failed(self) -> bool:
        return not self.unfinished and (self.error is not None or self.status != 200 or self.tokens is None)

    @property
    def completed(self) -> bool:
        return not self.unfinished and not self.failed

    @property
    def server_error(self) -> bool:
        """A fast 500: a 5xx status, or an error event in the stream."""
        return (self.status is not None and self.status >= 500) or self.error_event

    def gaps(self) -> list[tuple[float, float]]:
        """``(length, end)`` of each pause between consecutive text events."""
        times = [t for t, _ in self.events]
        return [(b - a, b) for a, b in itertools.pairwise(times)]

    @property
    def longest_stall(self) -> float:
        return max((length for length, _ in self.gaps()), default=0.0)

    def in_flight(self, at: float) -> bool:
        return self.sent <= at and (self.ended is None or self.ended > at)

    def streaming(self, at: float) -> bool:
        first = self.first
        return self.in_flight(at) and first is not None and first <= at


def request_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def reference_texts(url: str, model: str, prompts: Sequence[str], max_tokens: int) -> list[str]:
    """Each prompt's answer, undisturbed and not streamed (this also warms the replica up)."""
    texts = []
    for prompt in tqdm(prompts, desc="references", unit="req", file=sys.stderr):
        answer = requests.post(
            f"{url}/v1/completions",
            json=request_body(model, prompt, max_tokens),
            timeout=(CONNECT_TIMEOUT_S, REFERENCE_TIMEOUT_S),
        )
        if answer.status_code != 200:
            raise RuntimeError(f"a reference request failed before any fault: HTTP {answer.status_code}: {answer.text}")
        texts.append(answer.json()["choices"][0]["text"])
    return texts


def stream_into(
    session: requests.Session,
    url: str,
    body: dict[str, Any],
    record: StreamRecord,
    clock: Callable[[], float],
    stop: threading.Event,
) -> None:
    """Stream one completion into ``record``; once ``stop`` is set, cut it (``record.cut``) at its next line."""
    finished = False  # the answer ended, one way or another (else it was cut)
    try:
        with session.post(
            f"{url}/v1/completions",
            json={**body, "stream": True},
            stream=True,
            timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        ) as answer:
            record.status = answer.status_code
            if answer.status_code != 200:
                record.error = f"HTTP {answer.status_code}: {answer.text[:200]}"
                finished = True
                return
            for line in answer.iter_lines():
                now = clock()
                if stop.is_set():
                    return
                if not line.startswith(b"data: "):
                    continue
                if line == b"data: [DONE]":
                    finished = True
                    return
                event = json.loads(line[len(b"data: ") :])
                if "error" in event:
                    record.error_event = True
                    record.error = str(event["error"].get("message"))
                    continue
                text = event["choices"][0].get("text") or ""
                if text:
                    record.events.append((now, text))
                if event.get("usage"):
                    record.tokens = int(event["usage"]["completion_tokens"])
            record.error = record.error or "the stream ended without [DONE]"
            finished = True
    except requests.RequestException as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        finished = not stop.is_set()
    except (ValueError, KeyError, IndexError, TypeError) as exc:  # an event that is not what the API sends
        record.error = f"malformed event: {exc!r}"
        finished = True
    finally:
        if finished:
            record.ended = clock()
        else:
            record.cut = True
            record.error = record.error or "still running at the drain limit"
