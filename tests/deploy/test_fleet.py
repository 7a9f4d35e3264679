"""The fleet with real components: three ``phasewatch serve`` replicas, each fed only the
traces the OpenTelemetry Collector's load-balancing exporter (``routing_key: traceID``)
would send it, and one more ``phasewatch serve`` fed everything; a real Prometheus
scrapes the four (docs/deploy.md, "Sidecar or fleet").

The routing is the Collector's hash ring (``tests/support/collector_ring.py``, where the
upstream file and versions are cited), keyed by the backends' ``host:port`` as the static
resolver gives them; spans go out through the OpenTelemetry SDK's own OTLP/gRPC
exporters, one per replica, each sent only its shard. The replicas run the fleet
overlay's own phasewatch.toml. What is sent:

* simulated vLLM traffic from two pods (``llm_request`` spans, each in its own trace);
* SGLang 0.5.23's own multi-process span trees (tests/fixtures/otlp/engines), replayed
  with fresh trace ids: unified, and disaggregated with both roles in one trace, as SGLang
  traces a request that came with a ``traceparent`` (the tap's, a tracing router's);
* tapped requests: the tap's record, as the span ``phasewatch tap --otlp-endpoint``
  sends (its ``OtlpRecorder``, exporting through the same route), and the engine's span,
  a child of the tap's.

The fleet's sums equal the single exporter's: request counts and token sums exactly,
phase duration sums to float rounding, quantiles of the summed native histograms exactly
(their buckets add); every SGLang request and every tapped request is joined on the
replica its trace went to (no ``waited``). Last, disaggregated SGLang spans as captured,
each role in a trace of its own: the ring puts some roles apart, and those requests are
counted by both replicas, each with one role, ``waited`` (what docs/deploy.md warns of).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from opentelemetry import context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode

from phasewatch.dashboard import queries
from phasewatch.sim import otlp_shapes
from phasewatch.sim.scenarios import scenario
from phasewatch.tap import trace_headers
from phasewatch.tap.observed import Observed
from phasewatch.tap.otlp_out import OtlpRecorder
from tests.conftest import scrape, wait_for
from tests.support import ROOT
from tests.support.collector_ring import CollectorRoute, Ring
from tests.support.prom import PrometheusServer
from tests.support.serve import ServeProcess

FLEET_CONFIG = ROOT / "deploy" / "kubernetes" / "fleet" / "phasewatch.toml"
SGLANG = ROOT / "tests" / "fixtures" / "otlp" / "engines" / "sglang-0.5.23"
WALL0_NS = 1_793_613_600 * 10**9  # the SGLang fixture's t = 0 (its README)
SERVED = "Qwen/Qwen2.5-7B-Instruct"  # vllm-qwen's model in phasewatch.toml
# --otlp-join-wait and --trace-join-wait: short, so that the last part waits briefly
JOIN_WAIT, TRACE_JOIN_WAIT = 2, 5
HISTOGRAMS = ("gen_ai_server_time_to_first_token_seconds",
              "phasewatch_inter_token_latency_seconds",
              "gen_ai_server_time_per_output_token_seconds",
              "gen_ai_server_request_duration_seconds")
BY = "group, model, engine, source"
SUCCESS = SpanExportResult.SUCCESS


# ---- SGLang's captured spans, replayed through the SDK with fresh trace ids -------------
def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def sglang_spans(name: str, rng: random.Random, shift_ns: int, one_trace: bool):
    """The set's spans as SDK spans, times moved by ``shift_ns``. A captured trace gets a
    fresh id of its own width (SGLang's own ids are 64-bit); with ``one_trace`` both
    roles of a disaggregated request share one fresh 128-bit trace and their roots a
    client's parent span, as when the request carried a ``traceparent``. Returns the
    spans and, per request id, the trace ids of its roles."""
    captured = []
    for path in sorted((SGLANG / name / "grpc").glob("*.pb")):
        for rs in ExportTraceServiceRequest.FromString(path.read_bytes()).resource_spans:
            resource = Resource(_attrs(rs.resource.attributes))
            for ss in rs.scope_spans:
                scope = InstrumentationScope(ss.scope.name, ss.scope.version or None)
                captured += [(resource, scope, sp) for sp in ss.spans]
    rid_of = {sp.trace_id: _attrs(sp.attributes)["rid"] for _, _, sp in captured
              if " Req " in sp.name}
    fresh, client = {}, {}

    def trace_of(old: bytes) -> int:
        key = rid_of.get(old, old) if one_trace else old
        if key not in fresh:
            fresh[key] = rng.getrandbits(128 if one_trace or any(old[:8]) else 64) or 1
        return fresh[key]

    def ctx(old: bytes, span_id: bytes, remote: bool = False) -> SpanContext:
        return SpanContext(trace_of(old), int.from_bytes(span_id, "big"), remote,
                           TraceFlags(TraceFlags.SAMPLED))

    spans = []
    for resource, scope, sp in captured:
        parent = ctx(sp.trace_id, sp.parent_span_id) if sp.parent_span_id else None
        if one_trace and " Req " in sp.name:  # the client's span: one per request
            rid = rid_of[sp.trace_id]
            client.setdefault(rid, sp.parent_span_id or rng.getrandbits(64).to_bytes(8, "big"))
            parent = ctx(sp.trace_id, client[rid], remote=True)
        code = StatusCode(sp.status.code)
        spans.append(ReadableSpan(
            sp.name, ctx(sp.trace_id, sp.span_id), parent, resource, _attrs(sp.attributes),
            [Event(e.name, _attrs(e.attributes), e.time_unix_nano + shift_ns)
             for e in sp.events],
            [Link(ctx(lk.trace_id, lk.span_id), _attrs(lk.attributes)) for lk in sp.links],
            SpanKind(sp.kind - 1) if sp.kind else SpanKind.INTERNAL,
            status=Status(code, sp.status.message if code is StatusCode.ERROR else None),
            start_time=sp.start_time_unix_nano + shift_ns,
            end_time=sp.end_time_unix_nano + shift_ns, instrumentation_scope=scope))
    roles: dict[str, set[int]] = {}
    for old, rid in rid_of.items():
        roles.setdefault(rid, set()).add(trace_of(old))
    return spans, roles


# ---- simulated vLLM pods and tapped requests ---------------------------------------------
def vllm_spans(pod: str, records, headers=None) -> list:
    """``llm_request`` spans of ``records`` as vLLM sends them from ``pod``; with
    ``headers`` (one W3C header pair per record), each a child of the tap's span."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create(
        {"service.name": "vllm-qwen", "k8s.pod.name": pod}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("vllm.tracing.otel")
    for i, r in enumerate(records):
        token = context.attach(TraceContextTextMapPropagator().extract(headers[i])) \
            if headers else None
        try:
            otlp_shapes.emit_vllm(tracer, r)
        finally:
            if token is not None:
                context.detach(token)
    spans = memory.get_finished_spans()
    provider.shutdown()
    return spans


def tap_record(r, traceparent: str) -> dict:
    """What the tap in front of the server saw of ``r``: the client's arrival a little
    before the engine's, each chunk a little after the engine emitted it."""
    _, trace, span, _ = traceparent.split("-")
    times = [t + 0.001 for t in r.token_times]
    return dict(arrival=r.arrival - 0.002, first_token=times[0], last_token=times[-1],
                finish=times[-1] + 0.001, prompt_tokens=r.prompt_tokens,
                cached_prompt_tokens=r.cached_prompt_tokens, output_tokens=r.output_tokens,
                finish_reason=r.finish_reason, token_times=times, trace_parent=f"{trace}-{span}")


# ---- the fleet ------------------------------------------------------------------------
@pytest.fixture
def fleet(tmp_path):
    """Three replicas and the single exporter, each with the fleet's configuration,
    --source-label (the tapped requests) and short join waits."""
    args = (f"--config={FLEET_CONFIG}", "--source-label", "true",
            "--otlp-join-wait", str(JOIN_WAIT), "--trace-join-wait", str(TRACE_JOIN_WAIT))
    procs = [ServeProcess(tmp_path, *args) for _ in range(4)]
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda p: p.start(timeout=60), procs))
        yield procs[:3], procs[3]
    finally:
        for p in procs:
            if p.proc is not None:
                p.stop()


@pytest.fixture
def route(fleet):
    """The Collector in front of the replicas (and a copy of everything to the single
    exporter): one SDK OTLP/gRPC exporter per replica, keyed by its host:port."""
    replicas, single = fleet
    route = CollectorRoute({f"127.0.0.1:{p.otlp_grpc_port}": OTLPSpanExporter(
        endpoint=f"127.0.0.1:{p.otlp_grpc_port}", insecure=True) for p in replicas},
        OTLPSpanExporter(endpoint=f"127.0.0.1:{single.otlp_grpc_port}", insecure=True))
    yield route
    route.shutdown()


def _by_group(prom: PrometheusServer, expr: str) -> dict[str, dict]:
    out: dict[str, dict] = {"fleet": {}, "single": {}}
    for r in prom.query(expr):
        labels = dict(r["metric"])
        out[labels.pop("group")][tuple(sorted(labels.items()))] = float(r["value"][1])
    return out


def test_the_fleet_sums_to_one_exporter_and_joins_every_request_on_its_shard(
        fleet, route, tmp_path):
    replicas, single = fleet
    replica_of = dict(zip(route.backends, replicas, strict=True))
    rng = random.Random(29)
    now = time.time()
    shift = (int(now) - 300) * 10**9 - WALL0_NS

    # 1. two vLLM pods; SGLang's trees, unified and disaggregated in one trace
    pods = {pod: scenario("chat").build(seed=seed).run(20.0, epoch=now - 40)
            for pod, seed in (("vllm-qwen-a", 1), ("vllm-qwen-b", 2))}
    for pod, records in pods.items():
        assert route.export(vllm_spans(pod, records)) is SUCCESS
    sglang_roles = {}
    for name, one_trace in (("unified-level3", False), ("disagg-level3", True)):
        spans, roles = sglang_spans(name, rng, shift, one_trace)
        assert route.export(spans) is SUCCESS
        assert all(len(t) == 1 for t in roles.values())  # each request in one trace
        sglang_roles |= {f"{name}/{rid}": t for rid, t in roles.items()}

    # 2. tapped requests: the tap's records as OTLP spans through the same Collector
    # (phasewatch tap --otlp-endpoint: its OtlpRecorder, whose exporter is the route),
    # then the engine's spans; the ring puts both halves of each on one replica
    tapped = scenario("chat").build(seed=3).run(6.0, epoch=now - 20)
    headers = [dict(zip(("traceparent", "tracestate"), trace_headers(None), strict=True))
               for _ in tapped]
    tap_replica = [route.endpoint_of(int(h["traceparent"].split("-")[1], 16))
                   for h in headers]
    taps = OtlpRecorder(route, "vllm", resource=Resource.create(
        {"service.name": "phasewatch-tap", "k8s.pod.name": "vllm-qwen-a"}), interval=3600)
    for r, h in zip(tapped, headers, strict=True):
        taps(SERVED, tap_record(r, h["traceparent"]), Observed(path="/v1/chat/completions"))
    taps.close(shutdown_exporter=False)  # sends what waits, through the route
    assert taps.stats == {"sent": len(tapped), "accepted": len(tapped)}, taps.stats
    assert route.export(vllm_spans("vllm-qwen-a", tapped, headers)) is SUCCESS

    total = sum(map(len, pods.values())) + len(sglang_roles) + len(tapped)
    targets = {f"127.0.0.1:{p.http_port}": {"group": "fleet", "replica": str(i)}
               for i, p in enumerate(replicas)}
    targets[f"127.0.0.1:{single.http_port}"] = {"group": "single", "replica": "all"}
    with PrometheusServer(tmp_path, list(targets), target_labels=targets,
                          native_histograms=True) as prom:
        settled = f"sum by (group) (phasewatch_requests_total) == {total}"
        deadline = time.monotonic() + 30
        while len(prom.query(settled)) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(prom.query(settled)) == 2, prom.query("sum by (group) "
                                                         "(phasewatch_requests_total)")
        time.sleep(1.5)  # one more scrape: everything else of the same requests

        # The fleet's sums are the single exporter's, label set by label set.
        for expr, exact in (
                (f"sum by ({BY}, pod, finish_reason) (phasewatch_requests_total)", True),
                (f"sum by ({BY}, pod, kind) (phasewatch_tokens_total)", True),
                (f"sum by ({BY}, phase) (phasewatch_phase_duration_seconds_count)", True),
                (f"sum by ({BY}, phase) (phasewatch_phase_duration_seconds_sum)", False),
                *((f"sum by ({BY}) ({h}_count)", True) for h in HISTOGRAMS)):
            got = _by_group(prom, expr)
            assert got["fleet"].keys() == got["single"].keys() and got["single"], expr
            for key, value in got["single"].items():
                assert (got["fleet"][key] == value if exact else
                        got["fleet"][key] == pytest.approx(value, rel=1e-9)), (expr, key)
        # Quantiles of the summed native histograms: the buckets add, so they are equal.
        compared = 0
        for metric in [*HISTOGRAMS, "phasewatch_phase_duration_seconds"]:
            extra = ", phase" if metric.startswith("phasewatch_phase") else ""
            for q in (0.5, 0.9, 0.99):
                got = _by_group(prom, f"histogram_quantile({q}, sum by ({BY}{extra}) "
                                      f"({metric}_native))")
                assert got["fleet"].keys() == got["single"].keys() and got["single"]
                for key, value in got["single"].items():
                    if not math.isnan(value):
                        assert got["fleet"][key] == value, (metric, q, key)
                        compared += 1
        joined = _by_group(prom, f"sum by ({BY}) (phasewatch_requests_total"
                                 '{source="joined"})')
        assert sum(joined["fleet"].values()) == sum(joined["single"].values()) == len(tapped)
        per_replica = {r["metric"]["replica"]: float(r["value"][1]) for r in prom.query(
            'sum by (replica) (phasewatch_requests_total{group="fleet"})')}
        assert len(per_replica) == 3 and min(per_replica.values()) > 0, per_replica

        # The dashboard counts verdicts by pod, not by series: each replica publishes one
        # for every sending pod it holds a share of, and "2 of 6 pods agree" would have
        # counted replicas x pods. The fleet reports as many pods as the single exporter.
        def reporting(group: str) -> dict:
            expr = queries.render(queries.VERDICT_REPORTING, f'group="{group}"', "1m")
            return {tuple(r["metric"].get(k, "") for k in ("model", "engine", "source")):
                    float(r["value"][1]) for r in prom.query(expr)}
        assert wait_for(lambda: reporting("single") and reporting("fleet").keys()
                        == reporting("single").keys(), 30, 0.5), "a verdict from each"
        single_pods, fleet_pods = reporting("single"), reporting("fleet")
        assert fleet_pods == single_pods, (fleet_pods, single_pods)
        series = prom.query('count(phasewatch_bottleneck_info{group="fleet"} == 1)')
        assert float(series[0]["value"][1]) > sum(fleet_pods.values())  # replicas x pods

    # Joined whole on the replica their trace went to, nowhere waited or alone.
    sglang_at = Counter(route.endpoint_of(next(iter(t))) for t in sglang_roles.values())
    tapped_at = Counter(tap_replica)
    for endpoint, p in replica_of.items():
        s = scrape(p.http_port)
        assert s.total("phasewatch_otlp_joined_requests_total",
                       outcome="complete") == sglang_at[endpoint], endpoint
        assert s.total("phasewatch_trace_join_requests_total",
                       outcome="joined") == tapped_at[endpoint], endpoint
    for p in [*replicas, single]:
        s = scrape(p.http_port)
        for outcome in ("waited", "capacity"):
            assert not s.total("phasewatch_otlp_joined_requests_total", outcome=outcome)
        for outcome in ("tap_only", "engine_only", "capacity", "late"):
            assert not s.total("phasewatch_trace_join_requests_total", outcome=outcome)
        assert not s.total("phasewatch_otlp_join_pending")
        assert not s.total("phasewatch_trace_join_pending")
    single_scrape = scrape(single.http_port)
    assert single_scrape.total("phasewatch_otlp_joined_requests_total",
                               outcome="complete") == len(sglang_roles)

    # 3. disaggregated SGLang as captured: each role in its own trace
    before = {id(p): scrape(p.http_port).total("phasewatch_requests_total")
              for p in [*replicas, single]}
    spans, roles = sglang_spans("disagg-level1", rng, shift + 60 * 10**9, one_trace=False)
    apart = sum(len({route.endpoint_of(t) for t in traces}) > 1 for traces in roles.values())
    assert route.export(spans) is SUCCESS

    def settled():  # every root counted (after the waits, by the once-a-second sweep)
        out = [scrape(p.http_port) for p in [*replicas, single]]
        return out if not any(s.total("phasewatch_otlp_join_pending")
                              + s.total("phasewatch_trace_join_pending") for s in out) else None
    scrapes = wait_for(settled, timeout=3 * (JOIN_WAIT + TRACE_JOIN_WAIT), interval=0.5)
    assert scrapes, "requests still waiting"
    *fleet_scrapes, single_scrape = scrapes
    waited = sum(s.total("phasewatch_otlp_joined_requests_total", outcome="waited")
                 for s in fleet_scrapes)
    counted = sum(s.total("phasewatch_requests_total") - before[id(p)]
                  for s, p in zip(fleet_scrapes, replicas, strict=True))
    print(json.dumps({
        "replicas": {e: per_replica[str(i)] for i, e in enumerate(replica_of)},
        "requests": total, "sglang_joined_complete": dict(sglang_at),
        "tap_joined": dict(tapped_at), "quantiles_compared": compared,
        "disagg_as_captured": {"requests": len(roles), "roles_apart": apart,
                               "fleet_waited": waited, "fleet_counted": counted}}))
    assert apart > 0  # about 2/3 of the 12 requests without a traceparent
    assert waited == 2 * apart and counted == len(roles) + apart
    assert single_scrape.total("phasewatch_requests_total") - before[id(single)] == len(roles)
    assert not single_scrape.total("phasewatch_otlp_joined_requests_total", outcome="waited")


def test_the_ring_is_the_collectors_and_moves_a_quarter_of_the_traces_to_a_fourth_replica():
    """The upstream test vectors; order-invariance; and what docs/deploy.md says moves
    when a replica is added: about 1/N of the trace ids, all of them to the new one."""
    from tests.support.collector_ring import UPSTREAM_VECTORS

    for endpoints, weight, items in UPSTREAM_VECTORS["positions"]:
        assert Ring(endpoints, weight=weight).items == items
    endpoints, cases = UPSTREAM_VECTORS["endpoint_for"]
    ring = Ring(endpoints)
    assert len(ring.items) == 2 * 200
    for identifier, want in cases:
        assert ring.endpoint_for(identifier) == want, identifier
    assert Ring(["e1", "e2", "e3"], weight=2, positions=1, probe_limit=1).items == [
        (0, "e1")]
    three = [f"10.0.0.{i}:4317" for i in range(1, 4)]
    assert Ring(three).items == Ring(three[::-1]).items
    rng = random.Random(7)
    ids = [rng.getrandbits(128).to_bytes(16, "big") for _ in range(20_000)]
    before, after = Ring(three), Ring([*three, "10.0.0.4:4317"])
    moved = [i for i in ids if before.endpoint_for(i) != after.endpoint_for(i)]
    assert {after.endpoint_for(i) for i in moved} == {"10.0.0.4:4317"}
    assert 0.2 < len(moved) / len(ids) < 0.3, len(moved) / len(ids)
    # Not an even split: 200 points each leave the shares to the addresses' hashes (29 %,
    # 30 %, 41 % here). The busiest of 3 replicas at random addresses (docs/deploy.md):
    shares = Counter(before.endpoint_for(i) for i in ids)
    assert sum(abs(shares[e] / len(ids) - f) for e, f in before.shares().items()) < 0.03
    busiest = sorted(max(Ring([f"10.{rng.randrange(256)}.{rng.randrange(256)}."
                               f"{rng.randrange(1, 255)}:4317" for _ in range(3)])
                         .shares().values()) for _ in range(300))
    print(f"busiest of 3: p50 {busiest[150]:.1%}, p90 {busiest[270]:.1%}")
    assert 0.35 < busiest[150] < 0.39 and 0.39 < busiest[270] < 0.43
