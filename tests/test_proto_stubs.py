"""The committed gRPC stubs (python/fastsched/_proto/v1) match proto/fastsched/v1/generate.proto,
and a stale stub fails loudly: ``python -m fastsched.proto_gen --check`` and
:func:`fastsched.proto_gen.import_stubs` (issue 25 item 2, issue 28 item 6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc", reason="grpcio is not installed (the serve extra)")
pytest.importorskip("grpc_tools", reason="grpcio-tools is not installed (the test extra)")

from fastsched import proto_gen

REPO = Path(__file__).resolve().parents[1]


def _proto() -> Path:
    proto = proto_gen.find_proto()
    assert proto is not None, "proto/fastsched/v1/generate.proto is missing from the checkout"
    return proto


def test_committed_stubs_match_the_proto() -> None:
    """Fails after a .proto change until `python -m fastsched.proto_gen` is run and committed."""
    out = subprocess.run(
        [sys.executable, "-m", "fastsched.proto_gen", "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert proto_gen.is_up_to_date(_proto())


def test_the_check_names_the_stale_files_after_a_proto_change(tmp_path: Path) -> None:
    proto = tmp_path / "generate.proto"
    proto.write_text(_proto().read_text())
    out = tmp_path / "_proto" / "v1"
    proto_gen.generate(proto, out)
    assert proto_gen.stale_files(proto, out) == []
    assert proto_gen.is_up_to_date(proto, out)
    # The staged path makes the service module import its messages from inside this package.
    assert "from fastsched._proto.v1 import generate_pb2" in (out / "generate_pb2_grpc.py").read_text()
    text = proto.read_text()
    proto.write_text(
        text.replace("message HealthRequest {", "message HealthRequest {\n  string probe_field = 99;", 1)
    )
    assert proto.read_text() != text
    assert not proto_gen.is_up_to_date(proto, out)
    assert {"__init__.py", "generate_pb2.py", "generate_pb2.pyi"} <= set(proto_gen.stale_files(proto, out))


def test_import_stubs_refuses_stale_stubs_instead_of_regenerating(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = tmp_path / proto_gen.PROTO_RELPATH
    changed.parent.mkdir(parents=True)
    changed.write_text(_proto().read_text() + "\n// changed\n")
    monkeypatch.setenv("FASTSCHED_PROTO_DIR", str(tmp_path))
    monkeypatch.delitem(sys.modules, proto_gen.STUB_GRPC_MODULE, raising=False)
    before = sorted(p.name for p in proto_gen.OUTPUT_DIR.iterdir())
    with pytest.raises(ImportError, match="python -m fastsched.proto_gen"):
        proto_gen.import_stubs()
    assert sorted(p.name for p in proto_gen.OUTPUT_DIR.iterdir()) == before


def test_stubs_keep_the_wire_names_and_import_inside_the_package() -> None:
    pb, pb_grpc = proto_gen.import_stubs()
    assert pb_grpc.__name__ == "fastsched._proto.v1.generate_pb2_grpc"
    assert pb.DESCRIPTOR.package == "fastsched.v1"
    assert pb.DESCRIPTOR.services_by_name["Frontend"].full_name == "fastsched.v1.Frontend"
