"""Incremental detokenisation with stop strings: turns committed token ids into safe text deltas.

A delta is withheld while it could still change: while the text ends in an incomplete UTF-8
sequence (decoded as U+FFFD) or in a prefix of a stop string. When a stop string appears the
text is cut before it and the stream ends, exactly where token-by-token decoding would have cut
it, however many tokens arrive at once. Knows nothing about models or speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


class TextStream:
    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._decode = decode
        self._stop = tuple(stop)
        self._ids: list[int] = []
        self._emitted = 0  # characters of text already handed out
        self.text = ""
        self.stopped = False

    def push(self, new_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; return (text delta, how many of ``new_ids`` to keep — fewer after a stop string)."""
        if self.stopped:
            return "", 0
        start = len(self._ids)
        self._ids.extend(new_ids)
        full = self._decode(self._ids)
        if self._find_stop(full) is not None:
            # Stop where token-by-token decoding would have stopped, so the cut never depends on
            # how many tokens a cycle happened to commit at once.
            keep = self._tokens_to_stop(start, len(new_ids))
            self._ids = self._ids[: start + keep]
            prefix = self._decode(self._ids)
            cut = self._find_stop(prefix)
            assert cut is not None
            self.text = prefix[:cut]
            self.stopped = True
            return self._flush(len(self.text)), keep
        self.text = full
        return self._flush(self._safe_length(full)), len(new_ids)

    def emitted_up_to(self, chars: int) -> None:
        """Treat the first ``chars`` characters of the text as handed out already (a resumed request's client has
        them); later deltas start there."""
        self._emitted = min(max(chars, 0), len(self.text))

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        return self._flush(len(self.text))

    def _flush(self, upto: int) -> str:
        upto = max(upto, self._emitted)
        delta = self.text[self._emitted : upto]
        self._emitted = upto
        return delta

    def _find_stop(self, full: str) -> int | None:
        if not self._stop:
            return None
        longest = max(len(s) for s in self._stop)
        search_from = max(0, self._emitted - longest)
        hits = [i for s in self._stop if (i := full.find(s, search_from)) >= 0]
        return min(hits) if hits else None

    def _tokens_to_stop(self, start: int, count: int) -> int:
        for keep in range(1, count + 1):
            if self._find_stop(self._decode(self._ids[: start + keep])) is not None:
                return keep
        return count

    def _safe_length(self, full: str) -> int:
        safe = len(full)
        while safe > self._emitted and full[safe - 1] == "\ufffd":
            safe -= 1
        hold = 0  # longest tail of the text that is a proper prefix of some stop string
        for s in self._stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if full[safe - k : safe] == s[:k]:
                    hold = max(hold, k)
                    break
        return max(safe - hold, self._emitted)
