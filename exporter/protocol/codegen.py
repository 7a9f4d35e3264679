"""Generate the Python protocol module from ``proto/phasewatch/v1/phasewatch.proto``.

The generated ``phasewatch_pb2.py`` is committed (so installing phasewatch needs no
protoc), and ``tests/test_protocol_codegen.py`` regenerates it into a temporary
directory and fails when the committed copy is stale. Regenerate with
``make proto``. Only message types are generated: the service is wired with
grpcio's generic handlers (see ``exporter.grpc_server``) so that ``Export`` can
decode its payload itself, straight into numpy columns.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILE = "phasewatch/v1/phasewatch.proto"
TARGET = pathlib.Path(__file__).resolve().parent / "phasewatch_pb2.py"


def generate(out_file: pathlib.Path) -> None:
    """Run protoc (from grpcio-tools) and write the message module to ``out_file``."""
    from grpc_tools import protoc  # dev dependency, imported only here

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", str(PROTO_ROOT / PROTO_FILE)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILE}")
        shutil.copyfile(pathlib.Path(tmp) / "phasewatch/v1/phasewatch_pb2.py", out_file)


if __name__ == "__main__":
    generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else TARGET)
