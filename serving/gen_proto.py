"""Regenerates the gRPC stubs in `serving/gen/` from `serving/proto/jaxlora/v1/inference.proto`.

    python -m serving.gen_proto            # rewrite serving/gen/
    python -m serving.gen_proto --out DIR  # write elsewhere (the sync test compares the two)

protoc names modules after the proto path (`jaxlora.v1`), which would clash with the `jaxlora`
package; the stubs are moved into `serving.gen` and import each other relatively.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTO_ROOT = HERE / "proto"
PROTO = "jaxlora/v1/inference.proto"
OUT = HERE / "gen"
STUBS = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")
_ABSOLUTE_IMPORT = "from jaxlora.v1 import inference_pb2 as"
_RELATIVE_IMPORT = "from . import inference_pb2 as"


def generate(out: Path) -> list[Path]:
    """Runs protoc (grpcio-tools) and writes the stubs into `out`. Returns the written files."""
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO}")
        written = []
        for name in STUBS:
            text = (Path(tmp) / "jaxlora" / "v1" / name).read_text()
            (out / name).write_text(text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT))
            written.append(out / name)
    init = out / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC stubs (python -m serving.gen_proto); do not edit."""\n')
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT})")
    args = p.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
