"""Generates the Python stubs of protos/ into tandem/v1 (committed; a test checks they are current).

Run `python -m tandem.protogen` after editing a .proto file.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTOS / "tandem" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> None:
    """Writes <out_dir>/tandem/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py."""
    from grpc_tools import protoc

    args = [
        "grpc_tools.protoc",
        f"-I{PROTOS}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))


if __name__ == "__main__":
    generate(ROOT)
    sys.exit(0)
