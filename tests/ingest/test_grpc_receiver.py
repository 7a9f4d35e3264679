"""The gRPC receiver under bad input: protocol errors, counted, exporter stays up."""

import grpc
import pytest

from phasewatch.aggregation.labels import OVERFLOW, LabelSets
from phasewatch.ingest import wire
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.selfstats import SelfStats
from tests.conftest import scrape


def test_malformed_export_is_invalid_argument_and_counted(exporter):
    with grpc.insecure_channel(f"127.0.0.1:{exporter.grpc_port}") as ch:
        export = ch.unary_unary("/phasewatch.v1.Phasewatch/Export")
        with pytest.raises(grpc.RpcError) as e:
            export(b"\x0a\xff\xff", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        good = RequestBatch.from_records([RequestRecord("m", arrival=1.0, finish=2.0)])
        reply = wire.decode_export_response(export(wire.encode_export(good, "e"), timeout=5))
        assert reply.accepted == 1  # still serving
    m = scrape(exporter.http_port)
    assert m.value("phasewatch_ingest_batches_total", outcome="malformed") == 1
    assert m.value("phasewatch_ingest_rejected_total", reason="undecodable") == 1


def test_rejections_are_reported_back_to_the_sender(exporter):
    bad = RequestRecord("m", arrival=5.0, first_token=4.0)
    good = RequestRecord("m", arrival=1.0, first_token=1.5)
    payload = wire.encode_export(RequestBatch.from_records([bad, good, bad]), "e")
    with grpc.insecure_channel(f"127.0.0.1:{exporter.grpc_port}") as ch:
        reply = wire.decode_export_response(
            ch.unary_unary("/phasewatch.v1.Phasewatch/Export")(payload, timeout=5))
    assert (reply.accepted, reply.rejected) == (1, 2)
    assert [(r.reason, r.count) for r in reply.rejections] == [("clock_order", 2)]


def test_label_sets_are_capped_and_overflow_is_counted():
    stats = SelfStats()
    labels = LabelSets(stats, max_series=4)
    batch = RequestBatch.from_records(
        [RequestRecord(f"model-{i}", engine="e") for i in range(10)]
        + [RequestRecord("x" * 1000, engine="e")])
    rows = labels.rows(batch)
    assert len(labels) == 4 and labels.pairs()[-1] == (OVERFLOW, OVERFLOW)
    assert rows.max() == 3
    assert stats.get("phasewatch_ingest_label_overflow_total", label="model",
                     reason="too_many_series") == 8
    assert stats.get("phasewatch_ingest_label_overflow_total", label="model",
                     reason="too_long") == 1
