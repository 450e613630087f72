"""Tests of TextStream: safe text deltas, withheld partial stop strings and incomplete UTF-8, stop cuts."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from specserve.core.detokenize import TextStream


def byte_decode(ids: Sequence[int]) -> str:
    """Token id = one byte; incomplete UTF-8 decodes to U+FFFD like a byte-level tokenizer."""
    return bytes(ids).decode("utf-8", errors="replace")


def b(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def test_plain_deltas_concatenate_to_the_text() -> None:
    stream = TextStream(byte_decode)
    deltas = [stream.push(b(piece)) for piece in ("Hel", "lo", ", ", "world")]
    assert deltas == [("Hel", 3), ("lo", 2), (", ", 2), ("world", 5)]
    assert stream.finish() == ""
    assert stream.text == "Hello, world" and not stream.stopped


def test_incomplete_utf8_is_withheld() -> None:
    stream = TextStream(byte_decode)
    euro = b("€")  # 3 bytes
    assert len(euro) == 3
    assert stream.push(b("a") + euro[:1]) == ("a", 2)
    assert stream.push(euro[1:2]) == ("", 1)
    assert stream.push(euro[2:] + b("b")) == ("€b", 2)
    assert stream.text == "a€b"


def test_trailing_replacement_char_flushed_at_finish() -> None:
    stream = TextStream(byte_decode)
    assert stream.push([*b("ok"), 0xE2]) == ("ok", 3)
    assert stream.finish() == "\ufffd"  # generation ended inside a character: emit what there is
    assert stream.finish() == ""


def test_partial_stop_string_is_withheld() -> None:
    stream = TextStream(byte_decode, stop=["END"])
    assert stream.push(b("abE")) == ("ab", 3)
    assert stream.push(b("N")) == ("", 1)
    assert stream.push(b("X")) == ("ENX", 1)  # not a stop after all: release the held text
    assert not stream.stopped
    assert stream.push(b("E")) == ("", 1)
    assert stream.finish() == "E"  # generation ended for another reason: the held text is real text


def test_stop_string_cuts_text_and_counts_kept_tokens() -> None:
    stream = TextStream(byte_decode, stop=["END"])
    assert stream.push(b("hi ")) == ("hi ", 3)
    delta, keep = stream.push(b("xxENDyy"))
    assert (delta, keep) == ("xx", 5)  # tokens x, x, E, N, D are kept; y, y are dropped
    assert stream.stopped and stream.text == "hi xx"
    assert stream.push(b("more")) == ("", 0)
    assert stream.finish() == ""
    assert stream.text == "hi xx"


def test_stop_string_spanning_pushes() -> None:
    stream = TextStream(byte_decode, stop=["abc"])
    assert stream.push(b("zab")) == ("z", 3)
    assert stream.push(b("c")) == ("", 1)
    assert stream.stopped and stream.text == "z"


def test_stop_string_at_the_very_start() -> None:
    stream = TextStream(byte_decode, stop=["<|"])
    assert stream.push(b("<|rest")) == ("", 2)  # "<" and "|" are kept
    assert stream.stopped and stream.text == ""


def test_earliest_of_several_stop_strings_wins() -> None:
    stream = TextStream(byte_decode, stop=["world", "lo"])
    delta, keep = stream.push(b("hello world"))
    assert stream.stopped
    assert stream.text == "hel" and delta == "hel"
    assert keep == 5  # "hello" completes "lo"


def test_longest_held_prefix_among_stop_strings() -> None:
    stream = TextStream(byte_decode, stop=["xyz", "yzw"])
    assert stream.push(b("axy")) == ("a", 3)  # "xy" could start "xyz"
    assert stream.push(b("z")) == ("", 1)
    assert stream.stopped and stream.text == "a"


def test_multibyte_stop_string() -> None:
    stream = TextStream(byte_decode, stop=["€"])
    euro = b("€")
    assert stream.push(b("1") + euro[:2]) == ("1", 3)
    delta, keep = stream.push(euro[2:] + b("2"))
    assert (delta, keep) == ("", 1)
    assert stream.stopped and stream.text == "1"


def test_deltas_always_add_up() -> None:
    text = "the end is near, then: THE END. after"
    for stops in ((), ("END",), ("near", "zzz"), ("e",), ("after",)):
        for step in (1, 2, 3, 7):
            stream = TextStream(byte_decode, stop=stops)
            ids = b(text)
            out = ""
            kept = 0
            for i in range(0, len(ids), step):
                delta, keep = stream.push(ids[i : i + step])
                out += delta
                kept += keep
                if stream.stopped:
                    break
            out += stream.finish()
            assert out == stream.text
            hits = [text.find(s) for s in stops if s in text]
            cut = min(hits) if hits else len(text)
            assert stream.text == text[:cut], (stops, step)
            if hits:
                assert kept == min(text.find(s) + len(s) for s in stops if s in text)
            else:
                assert kept == len(ids)


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        TextStream(byte_decode, stop=["ok", ""])
