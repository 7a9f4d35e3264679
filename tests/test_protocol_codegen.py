"""The committed phasewatch_pb2.py must be what protoc makes of the committed .proto."""

import pathlib

from exporter.protocol import codegen


def test_generated_code_is_fresh(tmp_path: pathlib.Path):
    out = tmp_path / "phasewatch_pb2.py"
    codegen.generate(out)
    assert out.read_text() == codegen.TARGET.read_text(), (
        "exporter/protocol/phasewatch_pb2.py is stale: run `make proto` and commit it")
