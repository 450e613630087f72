"""Cycle traces: every speculation cycle as one msgpack record appended to a file, and read back.

A trace is what a policy experiment keeps of a run so that other policies can be replayed over
it later (:mod:`specserve.policies.simulator`): per cycle, which request and workload it
belonged to, the policy and the budget it chose, the shape that was actually drafted, how much
was accepted (and the accept flag per depth reached), and where the time went. A trace file is a
plain concatenation of msgpack maps, one per cycle (docs/policies.md#traces: msgpack frames the traces), so
appending from another run is just writing more maps at the end:

    with TraceWriter("runs/traces.msgpack") as writer:
        writer.write_many(TraceRecord.from_observation(obs, "req-0", i, "code-t0", "fixed:4", 0.0)
                          for i, obs in enumerate(result.stats.observations))
    records = read_trace("runs/traces.msgpack")

Every record carries a format version (``v``). :func:`read_trace` checks each record's fields and
types and reports a truncated or corrupt file as a :class:`~specserve.core.errors.UserError` that
names the record (index and byte offset). A file cut exactly between two records cannot be told
from a shorter trace; a flipped bit inside a number cannot be detected at all (there is no checksum).

This module only encodes and decodes records; it does not decide what to record (the experiment
harness does) and knows nothing about models or policies beyond the budget types.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import msgpack

from specserve.core.draft.schedule import Budget, CycleObservation
from specserve.core.errors import UserError
from specserve.core.tree.shapes import InvalidTree, TreeBudget, TreeSpec, TreeTopology

__all__ = ["TRACE_VERSION", "CorruptTrace", "TraceRecord", "TraceWriter", "read_trace", "read_traces"]

TRACE_VERSION = 1


class CorruptTrace(UserError):
    """A trace file that cannot be read back: truncated, not msgpack, or a record with bad fields."""


@dataclass(frozen=True)
class TraceRecord:
    """One speculation cycle of one request, as stored in a trace file."""

    request_id: str
    workload: str  # label of the prompt set / sampling setting the request belongs to
    policy: str  # the policy that chose the budget (e.g. "fixed:4", "adaptive")
    cycle: int  # index of the cycle within its request, from 0
    gamma: int  # the budget's chain length (0 = plain decoding)
    tree: TreeSpec | None  # the budget's tree, or None for chains
    nodes: int  # draft nodes actually sent (a drafter may return fewer; drafts are cut at the request's end)
    depth: int  # depth of what was sent (== nodes for a chain)
    accepted: int  # accepted path length (excluding the recovered/bonus token)
    accept_flags: tuple[bool, ...]  # [depths reached] accepted, then False at the first rejection
    draft_seconds: float
    verify_seconds: float
    wire_seconds: float
    batch_size: int
    temperature: float  # the request's sampling temperature (0 = greedy)
    remaining: int | None = None  # tokens the request could still emit when the cycle began (None = unknown)
    # positions the cycle's target forward computed (batch rows x widest block); 0 = nodes + 1 (verified alone)
    step_positions: int = 0

    def __post_init__(self) -> None:
        if self.cycle < 0 or self.gamma < 0 or self.nodes < 0 or self.depth < 0 or self.batch_size < 1:
            raise ValueError(f"cycle, gamma, nodes and depth must be >= 0 and batch_size >= 1: {self}")
        if not 0 <= self.accepted <= self.depth <= self.nodes:
            raise ValueError(f"need 0 <= accepted <= depth <= nodes, got {self.accepted}, {self.depth}, {self.nodes}")
        if self.step_positions < 0:
            raise ValueError(f"step_positions must be >= 0, got {self.step_positions}")

    @property
    def positions(self) -> int:
        """Positions the cycle's target forward computed: the whole batch's, or this request's block alone."""
        return self.step_positions or self.nodes + 1

    @property
    def tree_description(self) -> str | None:
        return self.tree.describe() if self.tree is not None else None

    @property
    def budget(self) -> Budget:
        return Budget(self.gamma, self.tree)

    @property
    def censored(self) -> bool:
        """True when every drafted position was accepted: the run of acceptable tokens may be longer."""
        return self.accepted == self.depth

    @property
    def seconds(self) -> float:
        """The cycle's cost on the critical path of a sequential run: draft + verify + wire."""
        return self.draft_seconds + self.verify_seconds + self.wire_seconds

    @staticmethod
    def from_observation(
        observation: CycleObservation,
        request_id: str,
        cycle: int,
        workload: str,
        policy: str,
        temperature: float,
        remaining: int | None = None,
    ) -> TraceRecord:
        return TraceRecord(
            request_id=request_id,
            workload=workload,
            policy=policy,
            cycle=cycle,
            gamma=observation.budget.gamma,
            tree=observation.budget.tree,
            nodes=observation.drafted,
            depth=observation.depth,
            accepted=observation.accepted,
            accept_flags=observation.accept_flags,
            draft_seconds=observation.draft_seconds,
            verify_seconds=observation.verify_seconds,
            wire_seconds=observation.wire_seconds,
            batch_size=observation.batch_size,
            temperature=temperature,
            remaining=remaining,
            step_positions=observation.step_positions,
        )

    def observation(self) -> CycleObservation:
        return CycleObservation(
            budget=self.budget,
            drafted=self.nodes,
            depth=self.depth,
            accepted=self.accepted,
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
            wire_seconds=self.wire_seconds,
            batch_size=self.batch_size,
            step_positions=self.step_positions,
        )

    # Encoding ----------------------------------------------------------------------------------

    def to_map(self) -> dict[str, Any]:
        return {
            "v": TRACE_VERSION,
            "request_id": self.request_id,
            "workload": self.workload,
            "policy": self.policy,
            "cycle": self.cycle,
            "gamma": self.gamma,
            "tree": self.tree_description,
            "tree_spec": _tree_to_map(self.tree),
            "nodes": self.nodes,
            "depth": self.depth,
            "accepted": self.accepted,
            "accept_flags": list(self.accept_flags),
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "wire_seconds": self.wire_seconds,
            "batch_size": self.batch_size,
            "temperature": self.temperature,
            "remaining": self.remaining,
            "step_positions": self.step_positions,
        }

    @staticmethod
    def from_map(data: Any) -> TraceRecord:
        """Decode one record; raises ``ValueError`` saying which field is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"expected a map, got {type(data).__name__}")
        version = data.get("v")
        if version != TRACE_VERSION:
            raise ValueError(f"unknown trace format version {version!r} (this reader knows {TRACE_VERSION})")
        flags = _field(data, "accept_flags", list)
        if not all(isinstance(flag, bool) for flag in flags):
            raise ValueError("accept_flags must be a list of booleans")
        remaining = data.get("remaining")
        if remaining is not None and (not isinstance(remaining, int) or isinstance(remaining, bool)):
            raise ValueError(f"remaining must be an integer or nil, got {remaining!r}")
        return TraceRecord(
            request_id=_field(data, "request_id", str),
            workload=_field(data, "workload", str),
            policy=_field(data, "policy", str),
            cycle=_field(data, "cycle", int),
            gamma=_field(data, "gamma", int),
            tree=_tree_from_map(data.get("tree_spec")),
            nodes=_field(data, "nodes", int),
            depth=_field(data, "depth", int),
            accepted=_field(data, "accepted", int),
            accept_flags=tuple(flags),
            draft_seconds=_seconds(data, "draft_seconds"),
            verify_seconds=_seconds(data, "verify_seconds"),
            wire_seconds=_seconds(data, "wire_seconds"),
            batch_size=_field(data, "batch_size", int),
            temperature=_number(data, "temperature"),
            remaining=remaining,
            step_positions=_field(data, "step_positions", int) if "step_positions" in data else 0,
        )


def _field(data: dict[str, Any], name: str, kind: type) -> Any:
    if name not in data:
        raise ValueError(f"missing field {name!r}")
    value = data[name]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    return value


def _number(data: dict[str, Any], name: str) -> float:
    if name not in data:
        raise ValueError(f"missing field {name!r}")
    value = data[name]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"field {name!r} must be a finite number, got {value!r}")
    return float(value)


def _seconds(data: dict[str, Any], name: str) -> float:
    value = _number(data, name)
    if value < 0:
        raise ValueError(f"field {name!r} must be >= 0, got {value}")
    return value


def _tree_to_map(tree: TreeSpec | None) -> dict[str, Any] | None:
    if tree is None:
        return None
    if tree.kind == "static":
        assert tree.topology is not None
        return {"kind": "static", "paths": [list(path) for path in tree.topology.paths]}
    assert tree.budget is not None
    budget = tree.budget
    return {
        "kind": "dynamic",
        "depth": budget.depth,
        "width": budget.width,
        "nodes": budget.nodes,
        "expand": budget.expand,
    }


def _tree_from_map(data: Any) -> TreeSpec | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ValueError("tree_spec must be a map or nil")
    try:
        if data.get("kind") == "static":
            return TreeSpec("static", topology=TreeTopology.from_lists(data["paths"]))
        if data.get("kind") == "dynamic":
            expand = data.get("expand")
            budget = TreeBudget(int(data["depth"]), int(data["width"]), int(data["nodes"]), expand and int(expand))
            return TreeSpec("dynamic", budget=budget)
    except (KeyError, TypeError, InvalidTree) as exc:
        raise ValueError(f"bad tree_spec {data!r}: {exc}") from exc
    raise ValueError(f"tree_spec kind must be 'static' or 'dynamic', got {data.get('kind')!r}")


# ---------------------------------------------------------------------------------------------
# Files


class TraceWriter:
    """Appends records to a trace file (created with its parent directory if missing); flushes per batch.

    Use as a context manager; each :meth:`write` / :meth:`write_many` call is one batch.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records_written = 0
        self._file: IO[bytes] | None = None
        self._packer = msgpack.Packer(use_bin_type=True)

    def __enter__(self) -> TraceWriter:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def open(self) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def write(self, record: TraceRecord) -> None:
        self.write_many((record,))

    def write_many(self, records: Iterable[TraceRecord]) -> int:
        """Append a batch of records and flush; returns how many were written."""
        if self._file is None:
            raise RuntimeError("TraceWriter is closed: use it as a context manager or call open()")
        chunks = [self._packer.pack(record.to_map()) for record in records]
        self._file.write(b"".join(chunks))
        self._file.flush()
        self.records_written += len(chunks)
        return len(chunks)


def read_trace(path: str | Path) -> list[TraceRecord]:
    """Every record of a trace file, in file order (an empty file is an empty trace)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"trace file {file} does not exist")
    size = file.stat().st_size
    records: list[TraceRecord] = []
    with file.open("rb") as handle:
        unpacker = msgpack.Unpacker(handle, raw=False, strict_map_key=True, use_list=True)
        while True:
            offset = unpacker.tell()
            where = f"trace file {file}: record {len(records)} (byte {offset} of {size})"
            try:
                data = unpacker.unpack()
            except msgpack.OutOfData:
                if offset < size:
                    raise CorruptTrace(
                        f"{where} is truncated: the file ends inside it (an interrupted write?)"
                    ) from None
                break
            except (ValueError, TypeError, msgpack.UnpackException) as exc:
                raise CorruptTrace(f"{where} is not valid msgpack: {exc}") from exc
            try:
                records.append(TraceRecord.from_map(data))
            except ValueError as exc:
                raise CorruptTrace(f"{where} is not a trace record: {exc}") from exc
    return records


def read_traces(paths: Iterable[str | Path]) -> list[TraceRecord]:
    """The records of several trace files, concatenated in the order given."""
    return [record for path in paths for record in read_trace(path)]
