"""The token datastore behind REST retrieval drafting: a suffix array over a tokenized corpus, on disk, memory-mapped.

Building (:func:`build_datastore`): the corpus's token ids, files joined by a separator (the id
``vocab_size``, outside the vocabulary: no context contains it and no draft crosses it), and their
suffix array by prefix doubling in numpy (:func:`suffix_array`; a few seconds for a few million
tokens), written with a header to one file. :func:`tokenize_texts` turns texts into that stream
with a tokenizer, and :func:`tokenizer_fingerprint` names the tokenizer.

The file (:data:`FORMAT_VERSION` 1), little-endian: a :data:`HEADER_SIZE`-byte header (magic
``SPSVREST``, format version, vocabulary size, token count, separator id, the two arrays' item
sizes, the tokenizer's fingerprint and a SHA-256 checksum of everything else), the tokens
(``uint32``), padding to 8 bytes, the suffix array (``uint32``, or ``int64`` beyond 2^32 tokens).
:meth:`Datastore.open` checks the header, the size and the checksum and maps both arrays with
:class:`numpy.memmap` (read-only; nothing is copied); every way a file can be wrong (missing, not a
datastore, another version, truncated, corrupt, another tokenizer: :meth:`Datastore.check_target`)
is a :class:`DatastoreError` that says how to rebuild it.

Querying (:meth:`Datastore.lookup`): the longest suffix of the context (at most ``max_length``
tokens) that occurs at least ``min_occurrences`` times, found by bisection over the length (a longer
suffix never occurs more often) with two binary searches over the suffix array per length; then the
continuations (up to ``depth`` tokens, cut at the separator) of at most ``max_occurrences``
occurrences spread evenly over the match's range, counted. The idea is REST (He et al. 2023,
"REST: Retrieval-Based Speculative Decoding"); the code is this project's. Drafting from the counts
is :mod:`specserve.drafters.rest`. Needs numpy and, for :func:`build_datastore`'s progress bar, tqdm;
no torch, no model.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specserve.core.errors import UserError

MAGIC = b"SPSVREST"
FORMAT_VERSION = 1
HEADER_SIZE = 128
# magic, version, header size, vocab size, tokens, separator, token itemsize, index itemsize, fingerprint, checksum
_HEADER = struct.Struct("<8sIIQQQII32s32s")
_CHECKSUMMED = _HEADER.size - 32  # the checksum covers the header before it, then the arrays
_CHUNK = 1 << 24  # bytes hashed at a time
TOKEN_DTYPE = np.dtype("<u4")
BUILD_HINT = "specserve datastore build --data FOLDER --tokenizer TARGET_DIR --out FILE"


class DatastoreError(UserError):
    """A datastore file that cannot be used (missing, not a datastore, another version or tokenizer, damaged)."""


@dataclass(frozen=True)
class DatastoreHeader:
    version: int
    vocab_size: int  # the tokenizer's size: every token id is below it
    num_tokens: int  # separators included
    separator: int  # == vocab_size: between files, never a draft
    index_itemsize: int  # 4 (uint32) or 8 (int64)
    fingerprint: bytes  # 32 bytes, tokenizer_fingerprint() of the tokenizer it was built with

    @property
    def tokens_offset(self) -> int:
        return HEADER_SIZE

    @property
    def index_offset(self) -> int:
        end = HEADER_SIZE + self.num_tokens * TOKEN_DTYPE.itemsize
        return end + (-end) % 8

    @property
    def file_size(self) -> int:
        return self.index_offset + self.num_tokens * self.index_itemsize

    @property
    def index_dtype(self) -> np.dtype:
        return np.dtype("<u4") if self.index_itemsize == 4 else np.dtype("<i8")

    def pack(self, checksum: bytes) -> bytes:
        packed = _HEADER.pack(
            MAGIC,
            self.version,
            HEADER_SIZE,
            self.vocab_size,
            self.num_tokens,
            self.separator,
            TOKEN_DTYPE.itemsize,
            self.index_itemsize,
            self.fingerprint,
            checksum,
        )
        return packed + bytes(HEADER_SIZE - len(packed))


@dataclass(frozen=True)
class Match:
    """What :meth:`Datastore.lookup` found for a context."""

    length: int  # tokens of the context's suffix that matched (0: none did)
    occurrences: int  # how often that suffix occurs in the datastore
    # the distinct continuations (1..depth tokens) of the occurrences looked at, each with how many had it
    continuations: tuple[tuple[tuple[int, ...], int], ...]

    @property
    def sampled(self) -> int:
        """Occurrences whose continuations were counted (at most ``max_occurrences``; empty ones excluded)."""
        return sum(count for _, count in self.continuations)


# ---------------------------------------------------------------------------------------------
# Building


def tokenizer_fingerprint(tokenizer: Any) -> bytes:
    """SHA-256 of the tokenizer's vocabulary (every token string and its id): two tokenizers that map any
    token to another id, or differ in size, differ here."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).digest()


def tokenizer_size(tokenizer: Any) -> int:
    """Token ids run from 0 to this (exclusive): the tokenizer's length, or past the largest id in its vocabulary."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values(), default=-1) + 1)


def tokenize_texts(texts: Iterable[str], tokenizer: Any, separator: int, progress: bool = False) -> np.ndarray:
    """Every text's token ids (no special tokens added), each followed by ``separator``, as one ``uint32`` array."""
    from tqdm import tqdm

    texts = list(texts)
    pieces: list[np.ndarray] = []
    bar = tqdm(total=len(texts), desc="tokenize", unit="file", disable=not progress, file=sys.stderr, leave=False)
    with bar:
        for start in range(0, len(texts), 64):
            batch = texts[start : start + 64]
            for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
                pieces.append(np.asarray([*ids, separator], dtype=TOKEN_DTYPE))
            bar.update(len(batch))
    return np.concatenate(pieces) if pieces else np.empty(0, dtype=TOKEN_DTYPE)


def suffix_array(tokens: np.ndarray, progress: bool = False) -> np.ndarray:
    """The start of every suffix of ``tokens`` in lexicographic order (a suffix that is a prefix of another sorts
    first), as int64: prefix doubling, each round one stable sort of (rank, rank ``k`` further on) pairs, until
    every rank is distinct (about log2 of the longest repeated run rounds). The bar counts sorted suffixes."""
    from tqdm import tqdm

    n = int(tokens.shape[0])
    if n == 0:
        return np.empty(0, dtype=np.int64)
    if n >= 2**31:
        raise UserError(f"a datastore holds fewer than 2^31 tokens, got {n}: build it from a smaller folder")
    # rank[i]: the class of the suffix at i by its first k tokens; dense, in order
    _, rank = np.unique(np.asarray(tokens, dtype=np.int64), return_inverse=True)
    rank = rank.astype(np.int64)
    order = np.argsort(rank, kind="stable")
    distinct = int(rank.max()) + 1
    with tqdm(total=n, desc="suffix array", unit="suffix", disable=not progress, file=sys.stderr, leave=False) as bar:
        bar.update(distinct)
        k = 1
        while distinct < n:
            following = np.zeros(n, dtype=np.int64)  # 0: past the end (before every real rank, shifted by 1)
            following[: max(n - k, 0)] = rank[k:] + 1
            key = rank * (n + 1) + following  # < n * (n + 1) + n + 1 < 2^63 for n < 2^31
            order = np.argsort(key, kind="stable")
            sorted_key = key[order]
            new_rank = np.empty(n, dtype=np.int64)
            new_rank[order] = np.concatenate(([0], np.cumsum(sorted_key[1:] != sorted_key[:-1])))
            rank = new_rank
            previous, distinct = distinct, int(rank.max()) + 1
            bar.update(distinct - previous)
            k *= 2
    return np.asarray(order, dtype=np.int64)


@dataclass(frozen=True)
class BuildSummary:
    path: Path
    tokens: int
    files: int
    bytes: int
    seconds: float


def build_datastore(
    tokens: np.ndarray,
    out: str | Path,
    *,
    vocab_size: int,
    fingerprint: bytes,
    progress: bool = False,
    files: int = 0,
) -> BuildSummary:
    """Write the datastore of ``tokens`` (ids below ``vocab_size``; ``vocab_size`` itself separates files) to
    ``out``: build the suffix array, then write the file through a temporary name, so that ``out`` is either the
    old file or the whole new one."""
    started = time.perf_counter()
    tokens = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
    if tokens.size and int(tokens.max()) > vocab_size:
        raise UserError(f"token id {int(tokens.max())} is beyond the vocabulary of {vocab_size} (and its separator)")
    if len(fingerprint) != 32:
        raise ValueError(f"a tokenizer fingerprint is 32 bytes, got {len(fingerprint)}")
    order = suffix_array(tokens, progress=progress)
    index_itemsize = 4 if tokens.size < 2**32 else 8
    header = DatastoreHeader(FORMAT_VERSION, vocab_size, int(tokens.size), vocab_size, index_itemsize, fingerprint)
    index = np.ascontiguousarray(order, dtype=header.index_dtype)
    padding = bytes(header.index_offset - header.tokens_offset - tokens.nbytes)
    digest = hashlib.sha256(header.pack(bytes(32))[:_CHECKSUMMED])
    for part in (tokens.data, padding, index.data):
        digest.update(part)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as handle:
        handle.write(header.pack(digest.digest()))
        handle.write(tokens.data)
        handle.write(padding)
        handle.write(index.data)
    os.replace(partial, path)
    size = path.stat().st_size
    assert size == header.file_size
    return BuildSummary(path, int(tokens.size), files, size, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------------
# Loading and querying


class Datastore:
    """A datastore file, its arrays memory-mapped (read-only: one instance may serve any number of threads)."""

    def __init__(self, path: Path, header: DatastoreHeader, tokens: np.ndarray, index: np.ndarray) -> None:
        self.path = path
        self.header = header
        self.tokens = tokens  # [num_tokens] uint32
        self.index = index  # [num_tokens] uint32 or int64: the suffix array

    @property
    def vocab_size(self) -> int:
        return self.header.vocab_size

    @property
    def num_tokens(self) -> int:
        return self.header.num_tokens

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> Datastore:
        """Map the datastore at ``path``; ``verify`` also reads it once to check its checksum (about 1 GB/s)."""
        file = Path(path)
        if not file.exists():
            raise DatastoreError(f"datastore {file} does not exist; build one with `{BUILD_HINT}`")
        if not file.is_file():
            raise DatastoreError(f"datastore {file} is not a file (a datastore is one file made by `{BUILD_HINT}`)")
        size = file.stat().st_size
        with open(file, "rb") as handle:
            raw = handle.read(HEADER_SIZE)
        if len(raw) < len(MAGIC) or raw[: len(MAGIC)] != MAGIC:
            raise DatastoreError(
                f"{file} is not a specserve datastore (it does not start with {MAGIC.decode()}); "
                f"build one with `{BUILD_HINT}`"
            )
        if len(raw) < _HEADER.size:
            raise DatastoreError(f"datastore {file} is truncated ({size} bytes, not even a header); rebuild it")
        _, version, header_size, vocab, count, separator, token_size, index_size, fingerprint, checksum = (
            _HEADER.unpack_from(raw)
        )
        if version != FORMAT_VERSION:
            raise DatastoreError(
                f"datastore {file} has format version {version} but this specserve reads version {FORMAT_VERSION}; "
                f"rebuild it with `{BUILD_HINT}`"
            )
        if header_size != HEADER_SIZE or token_size != TOKEN_DTYPE.itemsize or index_size not in (4, 8):
            raise DatastoreError(f"datastore {file} has a corrupt header; rebuild it with `{BUILD_HINT}`")
        header = DatastoreHeader(version, vocab, count, separator, index_size, fingerprint)
        if size < header.file_size:
            raise DatastoreError(
                f"datastore {file} is truncated: its header announces {count} tokens ({header.file_size} bytes) but "
                f"the file has {size} bytes; rebuild it with `{BUILD_HINT}`"
            )
        if size > header.file_size:
            raise DatastoreError(
                f"datastore {file} is corrupt: {size - header.file_size} bytes follow its arrays; rebuild it"
            )
        if count == 0:
            raise DatastoreError(f"datastore {file} holds no tokens; build it from a folder with text files")
        if verify:
            cls._verify(file, raw[:_CHECKSUMMED], checksum)
        tokens = np.memmap(file, dtype=TOKEN_DTYPE, mode="r", offset=header.tokens_offset, shape=(count,))
        index = np.memmap(file, dtype=header.index_dtype, mode="r", offset=header.index_offset, shape=(count,))
        return cls(file, header, tokens.view(np.ndarray), index.view(np.ndarray))

    @staticmethod
    def _verify(file: Path, header: bytes, checksum: bytes) -> None:
        digest = hashlib.sha256(header)
        with open(file, "rb") as handle:
            handle.seek(HEADER_SIZE)
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        if digest.digest() != checksum:
            raise DatastoreError(
                f"datastore {file} is corrupt: its contents do not match its checksum; rebuild it with `{BUILD_HINT}`"
            )

    def check_target(self, vocab_size: int, tokenizer: Any | None, target_path: str) -> None:
        """Raise :class:`DatastoreError` unless this datastore's token ids mean the same to the target: a target
        with a tokenizer must have the one the datastore was built with; one without (an in-memory model) must at
        least score every id the datastore holds."""
        rebuild = f"rebuild it with `specserve datastore build --tokenizer {target_path} ...`"
        if tokenizer is not None and tokenizer_fingerprint(tokenizer) != self.header.fingerprint:
            raise DatastoreError(
                f"datastore {self.path} was built with another tokenizer (vocabulary of {self.vocab_size} tokens) than "
                f"the target {target_path} (vocabulary of {tokenizer_size(tokenizer)} tokens); {rebuild}"
            )
        if self.vocab_size > vocab_size:
            raise DatastoreError(
                f"datastore {self.path} holds token ids up to {self.vocab_size - 1} but the target {target_path} "
                f"scores {vocab_size} tokens; {rebuild}"
            )

    # Queries ----------------------------------------------------------------------------------

    def _compare(self, start: int, pattern: np.ndarray) -> int:
        """-1, 0 or 1 as the suffix at ``start``, cut to ``len(pattern)`` tokens, sorts before, equal to or after it."""
        segment = self.tokens[start : start + pattern.shape[0]]
        length = segment.shape[0]
        differ = np.flatnonzero(segment != pattern[:length])
        if differ.size:
            at = int(differ[0])
            return -1 if segment[at] < pattern[at] else 1
        return -1 if length < pattern.shape[0] else 0

    def range_of(self, pattern: Sequence[int] | np.ndarray) -> tuple[int, int]:
        """``(lo, hi)``: the suffix array entries ``lo .. hi - 1`` are exactly the occurrences of ``pattern``."""
        needle = np.asarray(pattern, dtype=np.int64)
        if needle.size == 0:
            return 0, self.num_tokens
        lo, hi = 0, self.num_tokens
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            if self._compare(int(self.index[mid]), needle) < 0:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, self.num_tokens
        while lo < hi:  # first suffix > pattern (past every one that starts with it)
            mid = (lo + hi) // 2
            if self._compare(int(self.index[mid]), needle) <= 0:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_match(
        self, context: Sequence[int], max_length: int = 16, min_occurrences: int = 1
    ) -> tuple[int, int, int]:
        """``(length, lo, hi)`` for the longest suffix of ``context`` of at most ``max_length`` tokens that occurs
        at least ``min_occurrences`` times (``length`` 0 when not even its last token does). A suffix occurs at most
        as often as any shorter one, so the length is found by bisection."""
        tail = np.asarray(list(context[max(len(context) - max_length, 0) :]), dtype=np.int64)
        best = (0, 0, 0)
        lo_length, hi_length = 0, int(tail.size)
        while lo_length < hi_length:
            length = (lo_length + hi_length + 1) // 2
            lo, hi = self.range_of(tail[tail.size - length :])
            if hi - lo >= max(min_occurrences, 1):
                best, lo_length = (length, lo, hi), length
            else:
                hi_length = length - 1
        return best

    def lookup(
        self,
        context: Sequence[int],
        depth: int,
        max_length: int = 16,
        min_occurrences: int = 1,
        max_occurrences: int = 256,
    ) -> Match:
        """The continuations of the longest matching suffix of ``context`` (see the module docstring)."""
        length, lo, hi = self.longest_match(context, max_length, min_occurrences)
        if length == 0 or depth <= 0:
            return Match(length, hi - lo, ())
        rows = self.continuation_rows(lo, hi, length, depth, max_occurrences)
        if rows.shape[0] == 0:
            return Match(length, hi - lo, ())
        unique, counts = np.unique(rows, axis=0, return_counts=True)
        found = []
        for row, count in zip(unique.tolist(), counts.tolist(), strict=True):
            cut = row.index(-1) if -1 in row else len(row)
            if cut:
                found.append((tuple(row[:cut]), int(count)))
        return Match(length, hi - lo, tuple(found))

    def continuation_rows(self, lo: int, hi: int, length: int, depth: int, max_occurrences: int) -> np.ndarray:
        """``[occurrences, depth]`` int64: the ``depth`` tokens after each looked-at occurrence (suffix array
        entries ``lo .. hi - 1``, at most ``max_occurrences`` of them spread evenly), -1 from the separator or the
        end of the datastore on; rows that are all -1 are dropped."""
        count = hi - lo
        if count <= 0:
            return np.empty((0, depth), dtype=np.int64)
        picks = (
            np.arange(lo, hi)
            if count <= max_occurrences
            else lo + (np.arange(max_occurrences) * count) // max_occurrences
        )
        starts = self.index[picks].astype(np.int64) + length
        at = starts[:, None] + np.arange(depth, dtype=np.int64)[None, :]
        inside = at < self.num_tokens
        rows = self.tokens[np.minimum(at, self.num_tokens - 1)].astype(np.int64)
        rows[~inside] = self.header.separator
        rows[np.cumsum(rows == self.header.separator, axis=1) > 0] = -1
        return rows[rows[:, 0] >= 0]
