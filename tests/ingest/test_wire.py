"""The phasewatch protocol: columnar round trip, absent columns, malformed batches."""

import numpy as np
import pytest

from phasewatch.ingest import wire
from phasewatch.protocol import phasewatch_pb2 as pb
from phasewatch.requests.record import RequestBatch, RequestRecord

T = 1_700_000_000.0


def sample_batch() -> RequestBatch:
    return RequestBatch.from_records([
        RequestRecord("a", arrival=T, scheduled=T + 0.01, first_token=T + 0.1,
                      last_token=T + 0.12, finish=T + 0.13, prompt_tokens=100,
                      cached_prompt_tokens=10, output_tokens=3, finish_reason="stop",
                      request_id="r1", token_times=[T + 0.1, T + 0.11, T + 0.12]),
        RequestRecord("b", arrival=T + 1, output_tokens=1, request_id="r2"),
    ])


def test_round_trip_keeps_every_column():
    b = sample_batch()
    data = wire.encode_export(b, "vllm", batch_id=42, sender_dropped=7)
    got, meta = wire.decode_export(data)
    assert meta.engine == "vllm" and meta.batch_id == 42 and meta.sender_dropped == 7
    for col in ("arrival", "scheduled", "first_token", "last_token", "finish",
                "prompt_tokens", "cached_prompt_tokens", "output_tokens", "gap_counts"):
        np.testing.assert_array_equal(getattr(got, col), getattr(b, col), err_msg=col)
    assert got.strings_of(got.model) == ["a", "b"]
    assert got.strings_of(got.request_id) == ["r1", "r2"]
    assert got.strings_of(got.engine) == ["vllm", "vllm"]
    np.testing.assert_allclose(got.token_gaps, b.token_gaps, rtol=1e-6)  # float32 on the wire


def test_hand_encoding_is_what_protobuf_itself_reads():
    """Our packed-column writer must produce a message protobuf parses identically."""
    b = sample_batch()
    msg = pb.ExportRequest.FromString(wire.encode_export(b, "tgi"))
    assert list(msg.arrival_unix_nano) == b.arrival.tolist()
    assert list(msg.prompt_tokens) == b.prompt_tokens.tolist()
    assert list(msg.token_gap_count) == b.gap_counts.tolist()
    assert msg.request_count == 2 and msg.version == 1


def test_protobuf_encoded_batch_with_absent_columns_decodes():
    msg = pb.ExportRequest(version=1, engine="x", request_count=2, strings=["", "m"])
    msg.model_ref.extend([1, 1])
    msg.first_token_unix_nano.extend([5, 6])
    got, _ = wire.decode_export(msg.SerializeToString())
    assert got.arrival.tolist() == [0, 0]  # absent column: absent for every request
    assert got.output_tokens.tolist() == [-1, -1]
    assert got.first_token.tolist() == [5, 6]


@pytest.mark.parametrize("mutate,reason", [
    (lambda m: setattr(m, "version", 2), "unsupported_version"),
    (lambda m: m.arrival_unix_nano.append(1), "column_length"),
    (lambda m: m.model_ref.__setitem__(0, 99), "bad_string_ref"),
    (lambda m: m.token_gap_seconds.append(0.1), "gap_count_mismatch"),
    (lambda m: m.strings.__setitem__(0, "x"), "bad_string_table"),
])
def test_malformed_batches_raise_with_a_reason(mutate, reason):
    msg = pb.ExportRequest.FromString(wire.encode_export(sample_batch(), "e"))
    mutate(msg)
    with pytest.raises(wire.MalformedBatch) as e:
        wire.decode_export(msg.SerializeToString())
    assert e.value.reason == reason


def test_garbage_is_undecodable():
    with pytest.raises(wire.MalformedBatch) as e:
        wire.decode_export(b"\xff\xff\xff\xff")
    assert e.value.reason == "undecodable"
