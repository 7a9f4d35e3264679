"""The fleet overlay (``overlays/gateway``), rendered with ``kubectl kustomize``: the
OpenTelemetry Collector in front of phasewatch replicas. Its configuration routes every
trace by trace id (the load-balancing exporter's ``traceID`` routing key) to the ready
replicas its k8s resolver finds behind a headless Service that selects those replicas,
on the port where phasewatch receives OTLP/gRPC; its ServiceAccount may watch that
Service's EndpointSlices; the engines send their OTLP to the Collector's Service; every
replica is scraped on its own; the replicas' configuration is phasewatch's own central
mode; the dashboard reads Prometheus (the replicas summed), not one replica.

The renders and helpers are tests/deploy/test_kubernetes.py's (every overlay also passes the
checks there: schemas, namespace, images, probes, annotations). What only a cluster
shows (the Collector pulling the image, resolving the endpoints, routing) is not run
here: tests/deploy/test_fleet.py runs phasewatch replicas fed as the Collector's ring feeds them.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import pytest
import yaml

from phasewatch.cli import build_parser
from phasewatch.roofline import catalog
from phasewatch.roofline.deployments import resolve
from tests.deploy.test_kubernetes import (
    ENGINE_IMAGES,
    FLEET,
    OPERATOR_PIECE,
    _arg,
    _engine_model,
    _otlp_endpoint,
    _repo,
    _server,
    _tag,
    container,
    exporters,
    hardened,
    localised,
    of_kind,
    ports,
    render,
    serve_config,
    workers_follow_the_cpu_request,
)

COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib"
# The exporter's type, renamed in 0.154 (the old spelling is a deprecated alias).
LOAD_BALANCING = ("load_balancing", "loadbalancing")
# What the k8s resolver calls on the API server (the exporter's README, its
# example/k8s-resolver): EndpointSlices of the resolved Service.
RESOLVER_NEEDS = ("discovery.k8s.io", "endpointslices", {"get", "list", "watch"})


@pytest.fixture(scope="module")
def fleet() -> dict:
    """The render's pieces: the Collector (Deployment, container, its configuration),
    the phasewatch replicas (Deployment, container), Services by name, the rest."""
    docs = render(FLEET)
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    (collector,) = [d for d in deployments.values()
                    for c in d["spec"]["template"]["spec"]["containers"]
                    if _repo(c["image"]) == COLLECTOR_IMAGE]
    (otelcol,) = collector["spec"]["template"]["spec"]["containers"]
    (replicas,) = [d for d in deployments.values() if exporters([d])]
    return {"docs": docs, "deployments": deployments, "collector": collector,
            "otelcol": otelcol, "config": _collector_config(docs, collector, otelcol),
            "replicas": replicas, "phasewatch": container(replicas, "phasewatch"),
            "services": {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}}


def _collector_config(docs, deployment: dict, c: dict) -> dict:
    """The configuration file the Collector's --config names, from the ConfigMap mounted
    at that path."""
    (path,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--config=")]
    folder, _, name = path.rpartition("/")
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == folder]
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"]
                 if v["name"] == mount["name"]]
    (cm,) = [m for m in of_kind(docs, "ConfigMap")
             if m["metadata"]["name"] == volume["configMap"]["name"]]
    return yaml.safe_load(cm["data"][name])


def _selects(service: dict, deployment: dict) -> bool:
    return service["spec"]["selector"].items() <= deployment["spec"]["template"][
        "metadata"]["labels"].items()


def _expand(value: str, c: dict, namespace: str) -> str:
    """``${env:NAME}`` in the Collector's configuration, from the container's env (a
    literal, or the pod's namespace from the downward API)."""
    env = {e["name"]: e for e in c.get("env", [])}

    def one(m: re.Match) -> str:
        e = env[m[1]]
        if "value" in e:
            return e["value"]
        assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", e
        return namespace
    return re.sub(r"\$\{env:(\w+)\}", one, value)


def _load_balancing(config: dict) -> dict:
    (name,) = [n for n in config["exporters"] if n.split("/")[0] in LOAD_BALANCING]
    return config["exporters"][name] | {"name": name}


def test_the_collector_routes_every_trace_to_one_replica_behind_the_headless_service(
        fleet, tmp_path):
    lb = _load_balancing(fleet["config"])
    assert lb["routing_key"] == "traceID"
    assert lb["protocol"]["otlp"]["tls"]["insecure"] is True  # phasewatch's OTLP is plain
    assert list(lb["resolver"]) == ["k8s"], lb["resolver"]
    k8s = lb["resolver"]["k8s"]
    namespace = fleet["replicas"]["metadata"]["namespace"]
    name, _, ns = _expand(k8s["service"], fleet["otelcol"], namespace).partition(".")
    assert ns == namespace
    service = fleet["services"][name]
    # headless: the resolver gets one address per replica, not a balanced virtual IP
    assert service["spec"]["clusterIP"] == "None"
    # ... of the replicas, and of nothing else (not the Collector itself)
    assert [d for d in fleet["deployments"].values() if _selects(service, d)] == [
        fleet["replicas"]]
    assert fleet["replicas"]["spec"]["replicas"] == 3
    # the port the resolver adds to each address is where a replica receives OTLP/gRPC
    cfg = serve_config(*localised(fleet["docs"], fleet["phasewatch"], tmp_path))
    assert k8s["ports"] == [cfg.otlp_grpc_port]
    assert ports(fleet["phasewatch"])["otlp-grpc"] == cfg.otlp_grpc_port
    assert cfg.otlp_grpc_host == "0.0.0.0"
    # the traces pipeline ends in that exporter, and only there
    (pipeline,) = [p for n, p in fleet["config"]["service"]["pipelines"].items()
                   if n.split("/")[0] == "traces"]
    assert pipeline["exporters"] == [lb["name"]]
    assert pipeline["receivers"] == ["otlp"]


def test_the_collectors_account_may_watch_the_endpoint_slices(fleet):
    pod = fleet["collector"]["spec"]["template"]["spec"]
    account = pod["serviceAccountName"]
    assert pod.get("automountServiceAccountToken", True) is not False
    namespace = fleet["collector"]["metadata"]["namespace"]
    assert [a["metadata"]["name"] for a in of_kind(fleet["docs"], "ServiceAccount")] == [
        account]
    roles = {r["metadata"]["name"]: r for r in of_kind(fleet["docs"], "Role")}
    group, resource, verbs = RESOLVER_NEEDS
    granted = [b for b in of_kind(fleet["docs"], "RoleBinding")
               if {"kind": "ServiceAccount", "name": account, "namespace": namespace}
               in b["subjects"] and b["roleRef"]["kind"] == "Role"]
    rules = [r for b in granted for r in roles[b["roleRef"]["name"]]["rules"]
             if group in r["apiGroups"] and resource in r["resources"]]
    assert rules and verbs <= {v for r in rules for v in r["verbs"]}, rules
    # in its namespace only: no cluster-wide grant
    assert not of_kind(fleet["docs"], "ClusterRoleBinding")


def test_the_engines_send_their_otlp_to_the_collector(fleet):
    receiver = fleet["config"]["receivers"]["otlp"]["protocols"]
    listens = int(receiver["grpc"]["endpoint"].rsplit(":", 1)[1])
    assert receiver["grpc"]["endpoint"].startswith("0.0.0.0:")
    assert ports(fleet["otelcol"])["otlp-grpc"] == listens
    servers = [(name, *_server(d)) for name, d in fleet["deployments"].items()
               if any(_repo(c["image"]) in ENGINE_IMAGES
                      for c in d["spec"]["template"]["spec"]["containers"])]
    assert servers
    for name, engine, server in servers:
        host, port = _otlp_endpoint(server, engine)
        service = fleet["services"][host]
        assert _selects(service, fleet["collector"]), name
        (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == port]
        assert ports(fleet["otelcol"])[target] == listens, name


def test_every_replica_is_scraped_on_its_own(fleet, tmp_path):
    """Prometheus scrapes each replica's pod (not one Service address for all): the pod
    annotations name the port phasewatch serves /metrics on; the opt-in ServiceMonitor
    selects the headless Service, whose endpoints are the replicas; the Collector asks
    for no scrape under the exporters' job."""
    template = fleet["replicas"]["spec"]["template"]
    cfg = serve_config(*localised(fleet["docs"], fleet["phasewatch"], tmp_path))
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == cfg.http_port
    assert cfg.http_host == "0.0.0.0" and cfg.pod_label
    (monitor,) = of_kind(render(OPERATOR_PIECE), "ServiceMonitor")
    (service,) = [s for s in fleet["services"].values()
                  if monitor["spec"]["selector"]["matchLabels"].items()
                  <= s["metadata"]["labels"].items()]
    assert _selects(service, fleet["replicas"]) and service["spec"]["clusterIP"] == "None"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True  # the senders' pod label stays
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
    assert ports(fleet["phasewatch"])[port["targetPort"]] == cfg.http_port
    assert "prometheus.io/scrape" not in fleet["collector"]["spec"]["template"][
        "metadata"].get("annotations", {})


def test_the_collector_is_pinned_probed_and_locked_down(fleet):
    c = fleet["otelcol"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", _tag(c["image"])), c["image"]
    health = fleet["config"]["extensions"]["health_check"]["endpoint"]
    assert "health_check" in fleet["config"]["service"]["extensions"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert ports(c)[c[probe]["httpGet"]["port"]] == int(health.rsplit(":", 1)[1])
    hardened(c)
    assert fleet["collector"]["spec"]["template"]["spec"]["securityContext"][
        "seccompProfile"]["type"] == "RuntimeDefault"
    assert "memory_limiter" in fleet["config"]["service"]["pipelines"]["traces"][
        "processors"] and c["resources"]["limits"]["memory"]


def test_the_replicas_receive_what_the_servers_send(fleet, tmp_path):
    """Each replica is phasewatch's central mode: series by the sending pod (the
    resource's k8s.pod.name, which the server sets), the model from the service name the
    server sets, no engine /metrics (a central exporter cannot reach every server's)."""
    cfg = serve_config(*localised(fleet["docs"], fleet["phasewatch"], tmp_path))
    assert cfg.pod_label and cfg.max_pods >= 2
    engine, server = _server(fleet["deployments"]["vllm-qwen"])
    env = {e["name"]: e for e in server["env"]}
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == "k8s.pod.name=$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # nothing points a replica at one pod's engine: its causes come from the records
    assert not cfg.model_flags.engine_metrics_url
    assert not any(m.engine_metrics_url for m in cfg.models)
    # the service name the server sets maps to a configured model: the one it loads
    mapped = dict(p.split("=") for p in cfg.otlp_model_map.split(","))
    served = mapped[env["OTEL_SERVICE_NAME"]["value"]]
    (options,) = [m for m in cfg.models if m.served_model_name == served]
    model = _engine_model(engine, server)
    assert served == (_arg(server, "--served-model-name") or model)
    assert resolve(options).model.name == catalog.model(model).name


def test_the_dashboard_reads_the_replicas_summed(fleet):
    """One replica's JSON API holds only its share of the traces: the fleet's dashboard
    reads Prometheus, which sums the replicas."""
    dash = container(fleet["deployments"]["phasewatch-dashboard"], "dashboard")
    args = build_parser().parse_args(dash["args"])
    assert args.prometheus and not args.exporter


def test_the_taps_send_their_records_through_the_collector(fleet, tmp_path):
    """The tap in front of each vLLM pod sends its records as OTLP spans to the
    Collector's Service, on the port the Collector receives OTLP/gRPC (so the
    load-balancing exporter routes each to the replica holding its trace), names its pod,
    is what clients reach, and the replicas label sources and wait for both halves."""
    deployment = fleet["deployments"]["vllm-qwen"]
    tap = container(deployment, "phasewatch-tap")
    args = build_parser().parse_args(tap["args"])
    host, _, port = args.otlp_endpoint.rpartition(":")
    service = fleet["services"][host]
    assert _selects(service, fleet["collector"])
    (target,) = [p["targetPort"] for p in service["spec"]["ports"] if p["port"] == int(port)]
    receiver = fleet["config"]["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert ports(fleet["otelcol"])[target] == int(receiver.rsplit(":", 1)[1])
    # in front of the server, on the pod's loopback, with the server's engine label
    engine, server = _server(deployment)
    upstream = urlsplit(args.upstream)
    assert upstream.hostname == "127.0.0.1" and upstream.port == ports(server)["http"]
    assert args.engine == engine and args.host == "0.0.0.0"
    # clients reach the tap, not the server
    clients = fleet["services"]["vllm-qwen"]
    assert _selects(clients, deployment)
    (client_port,) = clients["spec"]["ports"]
    assert ports(tap)[client_port["targetPort"]] == args.port
    # its records name the pod, as the server's spans do
    env = {e["name"]: e for e in tap["env"]}
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == "k8s.pod.name=$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    workers_follow_the_cpu_request(tap)
    hardened(tap)
    cfg = serve_config(*localised(fleet["docs"], fleet["phasewatch"], tmp_path))
    assert cfg.source_label and cfg.trace_join_wait >= 5
