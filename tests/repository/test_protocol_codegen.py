"""The committed *_pb2.py modules must be what protoc makes of the committed .proto files."""

import pathlib

import pytest

from phasewatch.protocol import codegen


@pytest.mark.parametrize("proto", sorted(codegen.MODULES))
def test_generated_code_is_fresh(tmp_path: pathlib.Path, proto: str):
    target = codegen.MODULES[proto]
    out = tmp_path / target.name
    codegen.generate(out, proto)
    assert out.read_text() == target.read_text(), (
        f"exporter/protocol/{target.name} is stale: run `make proto` and commit it")
