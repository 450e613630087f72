"""Cycle traces: msgpack round trips of every field, appending, and clear errors on damaged files."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from specserve.core.draft.schedule import Budget, CycleObservation
from specserve.core.errors import UserError
from specserve.core.tree.shapes import TreeBudget, TreeSpec, TreeTopology
from specserve.policies.traces import CorruptTrace, TraceRecord, TraceWriter, read_trace, read_traces


def _records() -> list[TraceRecord]:
    static = TreeSpec("static", topology=TreeTopology.from_lists([[0], [1], [0, 0]]))
    dynamic = TreeSpec("dynamic", budget=TreeBudget(depth=3, width=2, nodes=5))
    observations = [
        CycleObservation(Budget(4), 4, 4, 2, 0.0013, 0.0171234567890123, 0.0, 1),
        CycleObservation(Budget(4), 3, 3, 3, 0.001, 0.016, 0.0002, 2),  # cut at the request's end, all accepted
        CycleObservation(Budget(0), 0, 0, 0, 0.0, 0.0135),  # plain decoding
        CycleObservation(Budget(0, static), 3, 2, 1, 0.002, 0.02),
        CycleObservation(Budget(0, dynamic), 5, 3, 0, 0.003, 0.021, 1e-4, 4, step_positions=24),  # a batched step
    ]
    ids = ["请求-0 ✓", "req/1", "ré\u0301q-2", "🙂", ""]
    return [
        TraceRecord.from_observation(obs, ids[i], i, "code-t1.5", "adaptive", 1.5, remaining=None if i == 2 else 9 - i)
        for i, obs in enumerate(observations)
    ]


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    path = tmp_path / "trace.msgpack"
    records = _records()
    with TraceWriter(path) as writer:
        assert writer.write_many(records[:2]) == 2
        writer.write_many(records[2:])
        writer.write(records[0])
        assert writer.records_written == 6
    back = read_trace(path)
    assert back == [*records, records[0]]
    first = back[0]
    assert first.request_id == "请求-0 ✓" and first.workload == "code-t1.5" and first.policy == "adaptive"
    assert (first.cycle, first.gamma, first.tree, first.nodes, first.depth, first.accepted) == (0, 4, None, 4, 4, 2)
    assert first.accept_flags == (True, True, False)
    assert first.verify_seconds == 0.0171234567890123  # float64 on the wire
    assert (first.batch_size, first.temperature, first.remaining) == (1, 1.5, 9)
    assert back[1].accept_flags == (True, True, True) and back[1].censored and back[1].wire_seconds == 0.0002
    assert back[2].remaining is None and back[2].accept_flags == ()
    assert back[3].tree_description == "static(3 nodes)" and back[3].tree == records[3].tree
    assert back[4].tree_description == "dynamic(depth=3, width=2, nodes=5)" and back[4].batch_size == 4
    assert (back[4].step_positions, back[4].positions, back[0].step_positions, back[0].positions) == (24, 24, 0, 5)
    raw = msgpack.unpackb(path.read_bytes()[: len(msgpack.packb(records[0].to_map()))], raw=False)
    assert raw["tree"] is None and raw["accept_flags"] == [True, True, False]  # what other readers see


def test_observation_round_trip() -> None:
    for record in _records():
        observation = record.observation()
        assert TraceRecord.from_observation(
            observation, record.request_id, record.cycle, record.workload, record.policy, record.temperature,
            record.remaining,
        ) == record  # fmt: skip
        assert observation.accept_flags == record.accept_flags


def test_writers_append(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "trace.msgpack"
    records = _records()
    with TraceWriter(path) as writer:
        writer.write_many(records[:3])
    with TraceWriter(path) as writer:
        writer.write_many(records[3:])
    assert read_trace(path) == records
    assert read_traces([path, path]) == records + records
    writer = TraceWriter(path)
    with pytest.raises(RuntimeError, match="closed"):
        writer.write(records[0])


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty").write_bytes(b"")
    assert read_trace(tmp_path / "empty") == []
    with pytest.raises(UserError, match="does not exist"):
        read_trace(tmp_path / "nope")


def _written(tmp_path: Path, count: int = 3) -> tuple[Path, list[int]]:
    """A trace of ``count`` records and the byte offset where each begins."""
    path = tmp_path / "trace.msgpack"
    offsets = []
    with TraceWriter(path) as writer:
        for record in _records()[:count]:
            offsets.append(path.stat().st_size)
            writer.write(record)
    return path, offsets


def test_truncated_file_names_the_record(tmp_path: Path) -> None:
    path, offsets = _written(tmp_path)
    data = path.read_bytes()
    for cut in (len(data) - 1, offsets[2] + 1, offsets[2] + 20):
        path.write_bytes(data[:cut])
        with pytest.raises(CorruptTrace, match=rf"record 2 \(byte {offsets[2]} of {cut}\) is truncated"):
            read_trace(path)
    path.write_bytes(data[: offsets[1] + 5])
    with pytest.raises(CorruptTrace, match="record 1"):
        read_trace(path)


def test_corrupt_bytes_name_the_record(tmp_path: Path) -> None:
    path, offsets = _written(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data + b"\xc1")  # a byte msgpack never uses
    with pytest.raises(CorruptTrace, match=r"record 3 .* is not valid msgpack"):
        read_trace(path)
    path.write_bytes(data + msgpack.packb(7))
    with pytest.raises(CorruptTrace, match=r"record 3 .* expected a map, got int"):
        read_trace(path)
    broken = bytearray(data)
    key = data.index(b"accepted", offsets[1])
    broken[key : key + 8] = b"acceptex"  # a damaged key: the field is missing
    path.write_bytes(bytes(broken))
    with pytest.raises(CorruptTrace, match=r"record 1 .* missing field 'accepted'"):
        read_trace(path)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("v", 99, "unknown trace format version 99"),
        ("cycle", "0", "field 'cycle' must be int"),
        ("cycle", True, "field 'cycle' must be int"),
        ("verify_seconds", -1.0, "must be >= 0"),
        ("temperature", float("nan"), "finite number"),
        ("accept_flags", [1, 0], "list of booleans"),
        ("accepted", 9, "accepted <= depth <= nodes"),
        ("tree_spec", {"kind": "banyan"}, "'static' or 'dynamic'"),
        ("remaining", 2.5, "remaining must be an integer"),
    ],
)
def test_bad_fields_are_reported(tmp_path: Path, field: str, value: object, message: str) -> None:
    data = _records()[0].to_map()
    data[field] = value
    path = tmp_path / "bad.msgpack"
    path.write_bytes(msgpack.packb(_records()[1].to_map()) + msgpack.packb(data))
    with pytest.raises(CorruptTrace, match=rf"record 1 .*{message}"):
        read_trace(path)


def test_records_written_before_batching_read_as_verified_alone() -> None:
    data = _records()[0].to_map()
    del data["step_positions"]
    record = TraceRecord.from_map(data)
    assert record.step_positions == 0 and record.positions == record.nodes + 1
