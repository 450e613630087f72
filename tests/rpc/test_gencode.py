"""The checked-in protobuf classes are exactly what `make protos` generates from protos/ (never hand-edited)."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    proto = "protos/specserve/v1/speculation.proto"
    args = ["protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}", str(ROOT / proto)]
    assert protoc.main(args) == 0
    for name in ("speculation_pb2.py", "speculation_pb2.pyi"):
        fresh = (tmp_path / "specserve" / "v1" / name).read_text()
        checked_in = (ROOT / "specserve" / "rpc" / "gen" / name).read_text()
        assert fresh == checked_in, f"specserve/rpc/gen/{name} is stale: run `make protos`"
