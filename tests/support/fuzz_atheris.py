"""Coverage-guided fuzzing (atheris, libFuzzer) of one target of ``tests/support/fuzz_targets``.

    python -m tests.support.fuzz_atheris TARGET SECONDS WORKDIR

phasewatch's own modules are instrumented for coverage; the run starts from seeds
that are valid inputs (so mutations reach the ingest paths, not only the first
parse error), stops after SECONDS, and exits non-zero with the crashing input saved
in WORKDIR if a target raised anything but its decoder's own error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import atheris

from tests.support import FIXTURES

with atheris.instrument_imports(include=["exporter"]):
    from tests.support import fuzz_targets


def seeds(name: str) -> list[bytes]:
    """Valid inputs for each target, made by phasewatch's own encoders."""
    from phasewatch.ingest import wire
    from phasewatch.requests.record import RequestBatch
    from phasewatch.sim.scenarios import scenario

    records = scenario("chat").build(seed=3).run(20.0, epoch=time.time() - 60)[:8]
    if name == "phasewatch_export":
        return [wire.encode_export(RequestBatch.from_records(records), "vllm", 5, 1)]
    if name == "phasewatch_lifecycle":
        from phasewatch.ingest.lifecycle import EventKind, LifecycleEvent

        t0 = int(records[0].arrival * 1e9)
        events = [LifecycleEvent(request_id="r", kind=k, time_unix_nano=t0 + i * 1000,
                                 model="m", prompt_tokens=5, output_tokens=3 if
                                 k is EventKind.FINISHED else None)
                  for i, k in enumerate(EventKind)]
        return [wire.encode_lifecycle("vllm", events)]
    if name in ("otlp_protobuf", "otlp_json"):
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        from phasewatch.ingest.otlp.jsonform import to_json
        from phasewatch.sim import otlp_shapes

        out = []
        for shape in otlp_shapes.SHAPES:
            mem = InMemorySpanExporter()
            tp = otlp_shapes.provider(shape, mem)
            tracer = otlp_shapes.tracer_for(tp, shape)
            for r in records[:3]:
                otlp_shapes.EMIT[shape](tracer, r)
            tp.force_flush()
            msg = encode_spans(mem.get_finished_spans())
            out.append(msg.SerializeToString() if name == "otlp_protobuf" else to_json(msg))
        return out
    if name == "tgi_duration":
        return [b"1.5ms", b"12.25\xc2\xb5s", b"3s", b"800ns"]
    if name == "config_file":
        return [b'grpc_port = 50051\nwindow_seconds = 30.0\nmodel = "Llama-3.1-8B"\n'
                b'[[models]]\nmodel = "Qwen2.5-7B"\nhardware = "H100-SXM"\n']
    if name == "hf_config":
        return [p.read_bytes() for p in sorted((FIXTURES / "hf")
                                               .rglob("*.json"))]
    raise KeyError(name)


def main(argv: list[str]) -> None:
    name, seconds, workdir = argv
    target = fuzz_targets.TARGETS[name]
    corpus = Path(workdir) / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(seeds(name)):
        (corpus / f"seed-{i}").write_bytes(seed)
    atheris.Setup([sys.argv[0], f"-max_total_time={seconds}", "-rss_limit_mb=2048",
                   f"-artifact_prefix={workdir}/", "-print_final_stats=1", str(corpus)],
                  target)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv[1:])
