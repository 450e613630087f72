"""Property-based tests (hypothesis) of the pure pieces: n-gram lookup, text streaming, stats."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.core.detokenize import TextStream
from specserve.core.stats import RequestStats
from specserve.drafters.ngram import lookup


def reference_lookup(history: Sequence[int], budget: int, max_n: int, min_n: int) -> list[int]:
    """Obvious quadratic version: longest n first, latest earlier match, tokens that followed it."""
    if budget <= 0:
        return []
    for n in range(min(max_n, len(history) - 1), min_n - 1, -1):
        suffix = list(history[len(history) - n :])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                return list(history[start + n : start + n + budget])
    return []


@settings(max_examples=300, deadline=None)
@given(
    history=st.lists(st.integers(0, 4), min_size=0, max_size=40),
    budget=st.integers(0, 6),
    sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_lookup_equals_reference(history: list[int], budget: int, sizes: tuple[int, int]) -> None:
    min_n, extra = sizes
    assert lookup(history, budget, min_n + extra, min_n) == reference_lookup(history, budget, min_n + extra, min_n)


def byte_decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="ab\né€", max_size=30),
    cuts=st.lists(st.integers(1, 4), max_size=30),
    stop=st.lists(st.text(alphabet="ab\né", min_size=1, max_size=3), max_size=2),
)
def test_text_stream_deltas_add_up_and_stop_is_exact(text: str, cuts: list[int], stop: list[str]) -> None:
    data = list(text.encode("utf-8"))
    stream = TextStream(byte_decode, stop)
    deltas, kept, pos = [], [], 0
    for size in [*cuts, len(data)]:
        chunk = data[pos : pos + size]
        pos += len(chunk)
        delta, keep = stream.push(chunk)
        deltas.append(delta)
        kept.extend(chunk[:keep])
        if stream.stopped or pos >= len(data):
            break
    deltas.append(stream.finish())
    # Oracle: decode one token at a time and stop at the first prefix that contains a stop string.
    expected, stopped_at = byte_decode(data), None
    for m in range(1, len(data) + 1):
        prefix = byte_decode(data[:m])
        hits = [i for s in stop if (i := prefix.find(s)) >= 0]
        if hits:
            expected, stopped_at = prefix[: min(hits)], m
            break
    assert "".join(deltas) == stream.text == expected
    assert stream.stopped == (stopped_at is not None)
    if stopped_at is not None:
        assert kept == data[:stopped_at]  # exactly the tokens up to the one that completed the stop


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), max_size=30))
def test_stats_counts_are_consistent(cycles: list[tuple[int, int]]) -> None:
    stats = RequestStats()
    for gamma, accepted in cycles:
        stats.record_cycle(gamma, min(accepted, gamma), 0.0, 0.0)
    assert stats.cycles == len(cycles)
    assert sum(stats.accepted) == stats.accepted_tokens
    assert all(a <= r for a, r in zip(stats.accepted, stats.reached, strict=True))
    assert all(later <= earlier for earlier, later in zip(stats.reached, stats.reached[1:], strict=False)) or any(
        g < len(stats.reached) for g, _ in cycles
    )
    assert sum(stats.accepted_length_histogram.values()) == stats.cycles
    if stats.cycles:
        assert stats.mean_accepted == sum(k * v for k, v in stats.accepted_length_histogram.items()) / stats.cycles
