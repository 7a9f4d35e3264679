"""Bad input, fuzzed: hypothesis over every decoder, then a bounded atheris run of each.

The targets (``tests/support/fuzz_targets.py``) decode and ingest as the receivers do and
fail on anything but the decoder's own error, or on a NaN, infinite or negative
observation left in a histogram. Here they get arbitrary bytes and, more usefully,
well-formed messages full of hostile values: the shapes the decoders accept, with
numbers and strings no engine should send.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from phasewatch.config import SERVE_OPTIONS
from phasewatch.ingest.otlp.jsonform import request_json
from phasewatch.protocol import phasewatch_pb2 as pb
from tests.support import fuzz_targets as t

SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Hostile numbers: NaN, infinities, negatives, zero, huge, tiny.
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, -1.0, 1e-300, 1e300, 1e9, 1e7, float("nan")]))
INT64 = st.one_of(st.integers(-(1 << 63), (1 << 63) - 1),
                  st.sampled_from([0, -1, 10**9, 10**18, -(10**18)]))
INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "x" * 5000, "\x00", "é" * 100]))


@pytest.mark.parametrize("name", sorted(t.TARGETS))
@SETTINGS
@given(data=st.binary(max_size=2000))
def test_arbitrary_bytes(name, data):
    t.TARGETS[name](data)


@st.composite
def export_requests(draw) -> bytes:
    n = draw(st.integers(0, 6))
    strings = ["", *draw(st.lists(TEXT, max_size=4))]
    col = lambda values: draw(st.one_of(st.just([]), st.lists(values, min_size=n,  # noqa: E731
                                                              max_size=n)))
    counts = draw(st.lists(st.integers(0, 40), min_size=n, max_size=n))
    msg = pb.ExportRequest(
        version=draw(st.sampled_from([1, 1, 1, 0, 2])), engine=draw(TEXT),
        batch_id=draw(st.integers(0, (1 << 64) - 1)), request_count=n, strings=strings,
        sender_dropped=draw(st.integers(0, 1 << 40)), sender_invalid=draw(st.integers(0, 99)),
        model_ref=col(st.integers(0, len(strings))),
        request_id_ref=col(st.integers(0, len(strings) - 1)),
        finish_reason_ref=col(st.integers(0, len(strings) - 1)),
        arrival_unix_nano=col(INT64), scheduled_unix_nano=col(INT64),
        first_token_unix_nano=col(INT64), last_token_unix_nano=col(INT64),
        finish_unix_nano=col(INT64), prompt_tokens=col(INT32),
        cached_prompt_tokens=col(INT32), output_tokens=col(INT32),
        token_gap_count=counts,
        token_gap_seconds=draw(st.lists(st.floats(width=32), min_size=sum(counts),
                                        max_size=sum(counts))))
    return msg.SerializeToString()


@SETTINGS
@given(data=export_requests())
def test_phasewatch_export_hostile_values(data):
    t.phasewatch_export(data)


@st.composite
def lifecycle_batches(draw) -> bytes:
    events = []
    for _ in range(draw(st.integers(0, 8))):
        events.append(pb.LifecycleEvent(
            request_id=draw(st.sampled_from(["a", "b", ""])), kind=draw(st.integers(0, 7)),
            time_unix_nano=draw(INT64), model=draw(TEXT), prompt_tokens=draw(INT32),
            has_prompt_tokens=draw(st.booleans()), first_emission_index=draw(
                st.integers(0, (1 << 32) - 1)),
            token_times_unix_nano=draw(st.lists(INT64, max_size=5)),
            output_tokens=draw(INT32), emission_count=draw(st.integers(0, (1 << 32) - 1)),
            last_token_unix_nano=draw(INT64)))
    return pb.LifecycleBatch(version=1, engine=draw(TEXT), events=events).SerializeToString()


@SETTINGS
@given(data=lifecycle_batches())
def test_phasewatch_lifecycle_hostile_values(data):
    t.phasewatch_lifecycle(data)


# Attribute names the adapters read, with values of every type and no sense.
ATTRIBUTES = ["gen_ai.latency.time_to_first_token", "gen_ai.latency.e2e",
              "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
              "gen_ai.latency.time_in_model_decode", "gen_ai.usage.prompt_tokens",
              "gen_ai.usage.completion_tokens", "gen_ai.usage.input_tokens",
              "gen_ai.usage.output_tokens", "gen_ai.request.model", "gen_ai.response.model",
              "gen_ai.request.id", "gen_ai.response.finish_reasons",
              "gen_ai.usage.cached_tokens", "validation_time", "queue_time", "inference_time",
              "time_per_token", "total_time", "model", "parameters"]
VALUES = st.one_of(FLOATS, INT64, TEXT, st.booleans(), st.just(None),
                   st.sampled_from(["1.5ms", "-3s", "1e999s", "NaNs", "12µs", "[\"stop\"]",
                                    "[" * 100_000, "[[[1]]]", "[]", "[1e999]"]))
SPAN_NAMES = ["llm_request", "generate_stream", "generate", "chat_completions", " Req ab12",
              "infer", "prefill", "chat Llama", "other"]


def _set(any_value, v) -> None:
    if isinstance(v, bool):
        any_value.bool_value = v
    elif isinstance(v, int):
        any_value.int_value = v
    elif isinstance(v, float):
        any_value.double_value = v
    elif isinstance(v, str):
        any_value.string_value = v


@st.composite
def otlp_requests(draw) -> ExportTraceServiceRequest:
    msg = ExportTraceServiceRequest()
    for _ in range(draw(st.integers(1, 2))):
        rs = msg.resource_spans.add()
        for key in ("service.name", "k8s.pod.name"):
            kv = rs.resource.attributes.add(key=key)
            _set(kv.value, draw(TEXT))
        ss = rs.scope_spans.add()
        ss.scope.name = draw(st.sampled_from(["vllm.tracing.otel", "sglang", "x"]))
        for _ in range(draw(st.integers(0, 5))):
            span = ss.spans.add(name=draw(st.sampled_from(SPAN_NAMES)),
                                kind=draw(st.integers(0, 5)))
            span.trace_id = draw(st.binary(min_size=16, max_size=16) | st.binary(max_size=20))
            span.span_id = draw(st.binary(min_size=8, max_size=8) | st.binary(max_size=10))
            span.start_time_unix_nano = draw(st.integers(0, (1 << 64) - 1))
            span.end_time_unix_nano = draw(st.integers(0, (1 << 64) - 1))
            for key in draw(st.lists(st.sampled_from(ATTRIBUTES), max_size=12, unique=True)):
                _set(span.attributes.add(key=key).value, draw(VALUES))
            if draw(st.booleans()):
                link = span.links.add(trace_id=span.trace_id, span_id=draw(st.binary(
                    min_size=8, max_size=8)))
                link.trace_id = span.trace_id
    return msg


@SETTINGS
@given(msg=otlp_requests())
def test_otlp_protobuf_hostile_values(msg):
    t.otlp_protobuf(msg.SerializeToString())


@SETTINGS
@given(msg=otlp_requests())
def test_otlp_json_hostile_values(msg):
    # ids in hex, as OTLP/JSON has them (MessageToJson's base64 ids are refused outright)
    t.otlp_json(json.dumps(request_json(msg)).encode())


@SETTINGS
@given(text=st.one_of(
    st.from_regex(r"\A\s*-?\d{0,400}(\.\d{0,20})?(e-?\d{1,4})?\s*(ns|µs|μs|us|ms|s|m|h)?\s*\Z"),
    st.text(max_size=30)))
def test_tgi_duration_strings(text):
    t.tgi_duration(text.encode())


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return {"nan": "nan", "inf": "inf", "-inf": "-inf"}.get(repr(v), repr(v))
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string
    return str(v)


@SETTINGS
@given(pairs=st.dictionaries(
    st.one_of(st.sampled_from([o.name for o in SERVE_OPTIONS]), st.text(min_size=1,
                                                                      max_size=8)),
    st.one_of(FLOATS, INT64, TEXT, st.booleans()), max_size=6))
def test_config_files(pairs):
    lines = [f"{json.dumps(k)} = {_toml_value(v)}" for k, v in pairs.items()]
    t.config_file("\n".join(lines).encode())


HF_KEYS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
           "head_dim", "intermediate_size", "vocab_size", "torch_dtype", "num_local_experts",
           "num_experts_per_tok", "moe_intermediate_size", "kv_lora_rank", "q_lora_rank",
           "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "tie_word_embeddings",
           "quantization_config", "n_routed_experts", "model_type", "text_config"]


@SETTINGS
@given(cfg=st.dictionaries(st.sampled_from(HF_KEYS), st.one_of(
    st.integers(-5, 1 << 40), st.sampled_from([0, 1, 4096, 32, 8, 128]), FLOATS, TEXT,
    st.booleans(), st.none(), st.just({"quant_method": "fp8"}), st.just([1, 2])),
    max_size=len(HF_KEYS)))
def test_hf_config_json(cfg):
    t.hf_config(json.dumps(cfg).encode())


ATHERIS_SECONDS = int(os.environ.get("PHASEWATCH_FUZZ_SECONDS", "8"))


@pytest.mark.parametrize("name", sorted(t.TARGETS))
def test_atheris_finds_nothing(name, tmp_path):
    """Coverage-guided fuzzing of each target for a bounded time (CI: 8 s each, set
    PHASEWATCH_FUZZ_SECONDS for longer runs); a crash fails with its input saved."""
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.fuzz_atheris", name, str(ATHERIS_SECONDS),
         str(tmp_path)],
        capture_output=True, text=True, timeout=ATHERIS_SECONDS + 120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "runs" in proc.stderr or "Done" in proc.stderr, proc.stderr[-2000:]
