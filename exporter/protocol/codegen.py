"""Generate the Python message modules from ``proto/phasewatch/v1/*.proto``.

``phasewatch.proto`` (the event protocol) becomes ``phasewatch_pb2.py``;
``exposition.proto`` (Prometheus's protobuf exposition, for native histograms)
becomes ``exposition_pb2.py``. Both are committed (so installing phasewatch needs no
protoc), and ``tests/repository/test_protocol_codegen.py`` regenerates them into a temporary
directory and fails when a committed copy is stale. Regenerate with
``make proto``. Only message types are generated: the service is wired with
grpcio's generic handlers (see ``phasewatch.ingest.grpc_server`` and
``phasewatch.transport.grpc``) so that ``Export`` can decode its payload itself,
straight into numpy columns.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "proto"
HERE = pathlib.Path(__file__).resolve().parent
# .proto under proto/ -> the committed module beside this file
MODULES = {
    "phasewatch/v1/phasewatch.proto": HERE / "phasewatch_pb2.py",
    "phasewatch/v1/exposition.proto": HERE / "exposition_pb2.py",
}
PROTO_FILE, TARGET = next(iter(MODULES.items()))  # the event protocol


def generate(out_file: pathlib.Path, proto_file: str = PROTO_FILE) -> None:
    """Run protoc (from grpcio-tools) on ``proto_file`` and write its message module
    to ``out_file``."""
    from grpc_tools import protoc  # dev dependency, imported only here

    with tempfile.TemporaryDirectory() as tmp:
        rc = protoc.main(
            ["protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", str(PROTO_ROOT / proto_file)]
        )
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {proto_file}")
        made = pathlib.Path(tmp) / proto_file.replace(".proto", "_pb2.py")
        shutil.copyfile(made, out_file)


if __name__ == "__main__":
    out_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
    for proto, target in MODULES.items():
        generate(out_dir / target.name if out_dir else target, proto)
