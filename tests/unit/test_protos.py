"""The committed stubs in tandem/v1 are what protoc generates from protos/ today."""

from pathlib import Path

from tandem.protogen import ROOT, generate


def test_generated_stubs_are_current(tmp_path):
    generate(tmp_path)
    generated = sorted((tmp_path / "tandem" / "v1").glob("*_pb2*.py*"))
    assert generated
    for fresh in generated:
        committed = ROOT / "tandem" / "v1" / fresh.name
        assert committed.exists(), f"{committed} missing: run python -m tandem.protogen"
        assert committed.read_text() == fresh.read_text(), f"{committed.name} is stale: run python -m tandem.protogen"


def test_every_proto_has_stubs():
    names = {p.stem for p in (ROOT / "protos" / "tandem" / "v1").glob("*.proto")}
    assert names == {"generate", "engine"}
    for name in names:
        assert (Path(ROOT) / "tandem" / "v1" / f"{name}_pb2_grpc.py").exists()
