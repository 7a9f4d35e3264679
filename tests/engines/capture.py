"""The engine-fixture generators' one capture harness (``make engine-fixtures``).

``vllm033_spans.py`` and ``sglang_spans.py`` each drive an engine's own tracing code in
a child process of their own script, once per OTLP protocol, against a local sink that
keeps every export as it was sent (``fixture_sink``). What they share is here:

* ``capture``: run the child once over OTLP/gRPC and once over OTLP/HTTP, each against a
  fresh sink; write every export to ``OUT/grpc/NNN.pb`` or ``OUT/http/NNN.pb`` (with the
  HTTP request line and headers in ``NNN.http.json``); hand back each run's result with
  its export count and its spans decoded;
* ``spans_of``: the spans of captured exports, attributes decoded;
* ``fixture_json``: JSON one key per line, short lists on one line (readable, small enough
  to commit);
* ``require_version``: the generator refuses an engine other than the one it names.

Run with the script's directory on ``sys.path`` (the generators are scripts:
``python tests/engines/vllm033_spans.py``), as ``fixture_sink`` is.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# each OTLP protocol a generator runs: the exporter's protocol setting, the sink, the
# fixture folder
PROTOCOLS = (("grpc", "GrpcSink", "grpc"), ("http/protobuf", "HttpSink", "http"))


def require_version(dist: str, want: str) -> str:
    """The installed version of ``dist``; exits naming the make target when it is not
    ``want`` (the fixtures name the version they were captured from)."""
    have = importlib.metadata.version(dist)
    if have != want:
        raise SystemExit(f"{dist} {have} installed, want {want}: make engine-fixtures "
                         f"builds the virtualenv")
    return have


def capture(script: str, out: Path, child_args: list[str],
            env: dict[str, str] | None = None, links_and_events: bool = False
            ) -> dict[str, dict]:
    """Run ``script --child --protocol P --endpoint E *child_args --result FILE`` for
    each of ``PROTOCOLS``; the child writes its result (JSON) to FILE. Returns, per
    fixture folder (``grpc``, ``http``), that result with ``exports`` (how many the sink
    kept) and ``spans`` (``spans_of`` the written files, ``links_and_events`` passed
    on)."""
    import fixture_sink

    env = dict(os.environ if env is None else env, PYTHONHASHSEED="0")
    results = {}
    for proto, sink_name, sub in PROTOCOLS:
        sink = getattr(fixture_sink, sink_name)().start()
        try:
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                subprocess.run([sys.executable, script, "--child", "--protocol", proto,
                                "--endpoint", sink.endpoint, *child_args,
                                "--result", tmp.name], check=True, env=env)
                results[sub] = json.loads(Path(tmp.name).read_text())
        finally:
            sink.stop()
        d = out / sub
        if d.exists():
            for p in d.iterdir():
                p.unlink()
        d.mkdir(parents=True, exist_ok=True)
        captured = sink.take()
        for i, c in enumerate(captured):
            (d / f"{i:03d}.pb").write_bytes(c.body)
            if sub == "http":
                (d / f"{i:03d}.http.json").write_text(json.dumps(
                    {"method": "POST", "path": c.path, "headers": c.headers}, indent=1) + "\n")
        results[sub]["exports"] = len(captured)
        results[sub]["spans"] = spans_of(sorted(d.glob("*.pb")), links_and_events)
    return results


def spans_of(pb_files: list[Path], links_and_events: bool = False) -> list[dict]:
    """Every span of the captured exports in order, attributes decoded; with
    ``links_and_events`` their counts too (SGLang's spans carry links and events)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    out = []
    for p in pb_files:
        req = ExportTraceServiceRequest.FromString(p.read_bytes())
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    span = {"name": sp.name, "kind": sp.kind, "scope": ss.scope.name,
                            "trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                            "parent_span_id": sp.parent_span_id.hex(),
                            "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano,
                            "attributes": {kv.key: getattr(kv.value,
                                                           kv.value.WhichOneof("value"))
                                           for kv in sp.attributes}}
                    if links_and_events:
                        span.update(links=len(sp.links), events=len(sp.events))
                    out.append(span)
    return out


def fixture_json(obj, records_inline: bool = False) -> str:
    """JSON with one key per line but short lists (of numbers, or of lists of numbers)
    on one line; with ``records_inline`` a dict whose values are all such (a leaf
    record) is one line too."""

    def flat(v) -> bool:
        return not isinstance(v, dict | list) or (
            isinstance(v, list) and all(not isinstance(x, dict | list) for x in v))

    def enc(v, ind: str) -> str:
        if isinstance(v, dict):
            if not v:
                return "{}"
            if records_inline and all(flat(x) for x in v.values()):
                return json.dumps(v, sort_keys=True, separators=(",", ":"))
            inner = ind + " "
            items = [f"{inner}{json.dumps(k)}: {enc(v[k], inner)}" for k in sorted(v)]
            return "{\n" + ",\n".join(items) + "\n" + ind + "}"
        if isinstance(v, list) and not all(flat(x) for x in v):
            inner = ind + " "
            return "[\n" + ",\n".join(inner + enc(x, inner) for x in v) + "\n" + ind + "]"
        return json.dumps(v, separators=(",", ":"))

    return enc(obj, "") + "\n"
