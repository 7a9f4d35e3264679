"""The Kubernetes manifests: every overlay renders with ``kubectl kustomize``, validates
against the Kubernetes schemas, and agrees with what the exporter actually serves:
container ports and probes are the exporter's configured ports and endpoints, the
inference server's OTLP flag points at the sidecar's OTLP/gRPC receiver, the sidecar
scrapes the server's own /metrics on its port in the pod (with the flags that publish
what it reads), and the exporter started with the container's own arguments and
environment answers its probes. Where the tap is deployed, it fronts the server (its
--upstream is the server's port, the Service's port reaches the tap) and, started with
its own arguments, is ready exactly when the server answers through it."""

from __future__ import annotations

import functools
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from exporter.cli import build_parser
from exporter.config import load_serve_config
from exporter.ingest.adapters import sglang as sglang_adapter
from exporter.ingest.adapters import tgi as tgi_adapter
from exporter.ingest.adapters import vllm as vllm_adapter
from tests.conftest import require_binary, terminate, wait_for

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
SIDECAR_OVERLAYS = [o for o in OVERLAYS if o != "gateway"]
# The oldest Kubernetes still in common support, and the newest the schemas know.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
# How each server is told where to send OTLP: (container, flag).
OTLP_FLAGS = {"vllm": "--otlp-traces-endpoint", "tgi": "--otlp-endpoint",
              "sglang": "--otlp-traces-endpoint"}
# The engine label each server's spans get: the tap in front of it records under the same.
ENGINE_LABELS = {"vllm": vllm_adapter.ENGINE, "sglang": sglang_adapter.ENGINE,
                 "tgi": tgi_adapter.ENGINE}
# Each server's overlay has the tap in front of it; its -engine-only twin has none.
TAPPED = {**{e: True for e in OTLP_FLAGS}, **{f"{e}-engine-only": False for e in OTLP_FLAGS}}
TAP_OVERLAYS = [o for o, tapped in TAPPED.items() if tapped]
TAP = "phasewatch-tap"
# What each server needs on its command line to serve what the sidecar scrapes from its
# /metrics: vLLM's FLOP/byte counters (at 0 without the flag) and cached prompt tokens in
# the usage the tap reads; SGLang's /metrics at all. TGI's router always serves it.
ENGINE_METRICS_FLAGS = {"vllm": ("--enable-mfu-metrics", "--enable-prompt-tokens-details"),
                        "sglang": ("--enable-metrics",), "tgi": ()}
# Seconds a server's /health takes at the least: SGLang's generates one token and first
# looks for it 1 s later (0.5.23, entrypoints/http_server.py, health_generate).
HEALTH_ANSWER_S = {"sglang": 1.0}


@functools.cache
def render(overlay: str) -> tuple[dict, ...]:
    kubectl = require_binary("kubectl", "it renders the kustomize overlays")
    r = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return tuple(d for d in yaml.safe_load_all(r.stdout) if d)


def of_kind(docs, kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def container(deployment: dict, name: str) -> dict:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return c


def exporter_container(docs) -> tuple[dict, dict]:
    """(Deployment, container) of the phasewatch exporter in a render."""
    for d in of_kind(docs, "Deployment"):
        for c in d["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "phasewatch":
                return d, c
    raise AssertionError("no phasewatch container")


def localised(docs, c: dict, tmp: Path) -> tuple[list[str], dict[str, str]]:
    """The container's args and env for a local run: the ConfigMap's files (if any)
    written to ``tmp`` and ``--config`` pointed there."""
    for cm in of_kind(docs, "ConfigMap"):
        for name, text in cm["data"].items():
            (tmp / name).write_text(text)
    args = [re.sub(r"^--config=.*/", f"--config={tmp}/", a) for a in c["args"]]
    assert args[0] == "serve", args
    return args, {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def serve_config(args: list[str], env: dict[str, str]):
    """The ServeConfig the exporter builds from these args and env."""
    return load_serve_config(build_parser().parse_args(args), env)


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def env_values(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def hardened(c: dict) -> None:
    security = c["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert not security["allowPrivilegeEscalation"] and security["capabilities"]["drop"] == [
        "ALL"]
    assert c["resources"]["requests"] and c["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates(overlay):
    docs = render(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "PrometheusRule"} <= kinds
    assert kinds & {"PodMonitor", "ServiceMonitor"}
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            continue  # CRDs: checked below
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: "
                            f"{e.message} at {'/'.join(map(str, e.path))}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_operator_resources_select_what_exists(overlay, tmp_path):
    docs = render(overlay)
    pods = [d["spec"]["template"] for d in of_kind(docs, "Deployment")]
    for pm in of_kind(docs, "PodMonitor"):
        selected = [p for p in pods if pm["spec"]["selector"]["matchLabels"].items()
                    <= p["metadata"]["labels"].items()]
        assert selected, f"PodMonitor {pm['metadata']['name']} selects no pod"
        for p in selected:
            names = {port["name"] for c in p["spec"]["containers"] for port in c.get("ports", [])}
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert ep["port"] in names and ep["path"] == "/metrics"
    for sm in of_kind(docs, "ServiceMonitor"):
        services = [s for s in of_kind(docs, "Service") if sm["spec"]["selector"]["matchLabels"]
                    .items() <= s["metadata"]["labels"].items()]
        assert services, f"ServiceMonitor {sm['metadata']['name']} selects no Service"
        for ep in sm["spec"]["endpoints"]:
            assert ep["port"] in {p["name"] for s in services for p in s["spec"]["ports"]}
    for monitor in of_kind(docs, "PodMonitor") + of_kind(docs, "ServiceMonitor"):
        endpoints = (monitor["spec"].get("podMetricsEndpoints")
                     or monitor["spec"]["endpoints"])
        # The job the PhasewatchExporterDown alert watches.
        assert all({"targetLabel": "job", "replacement": "phasewatch"} in e["relabelings"]
                   for e in endpoints)
    # The PrometheusRule's groups are the rule files' groups, and promtool accepts them.
    (rule,) = of_kind(docs, "PrometheusRule")
    shipped = [g for f in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"),
                                 reverse=True)
               for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == shipped
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool = require_binary("promtool", "it checks the PrometheusRule's groups")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def _server(deployment: dict) -> tuple[str, dict]:
    (c,) = [c for c in deployment["spec"]["template"]["spec"]["containers"]
            if c["name"] not in ("phasewatch", TAP)]
    return c["name"], c


def _otlp_endpoint(c: dict, engine: str) -> tuple[str, int]:
    flag = OTLP_FLAGS[engine]
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith(flag + "=")]
    url = urlsplit(value if "://" in value else "grpc://" + value)
    return url.hostname, url.port


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_sidecar_matches_what_the_exporter_serves(overlay, tmp_path):
    docs = render(overlay)
    dep, side = exporter_container(docs)
    cfg = serve_config(*localised(docs, side, tmp_path))
    assert ports(side) == {"phasewatch-http": cfg.http_port, "otlp-grpc": cfg.otlp_grpc_port,
                           "otlp-http": cfg.otlp_http_port, "phasewatch-grpc": cfg.grpc_port}
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                        ("readinessProbe", "/readyz")):
        assert side[probe]["httpGet"] == {"path": path, "port": "phasewatch-http"}
    # Ingest on the pod's loopback only; /metrics reachable by Prometheus.
    assert cfg.otlp_grpc_host == cfg.otlp_http_host == cfg.grpc_host == "127.0.0.1"
    assert cfg.http_host == "0.0.0.0"
    engine, server = _server(dep)
    assert _otlp_endpoint(server, engine) == ("localhost", cfg.otlp_grpc_port)
    assert cfg.model_flags.model and cfg.model_flags.hardware != "auto"
    hardened(side)


def _listen_port(c: dict) -> int:
    """The port the server listens on, from its own ``--port=N`` argument."""
    (value,) = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--port=")]
    return int(value)


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_sidecar_scrapes_the_engines_own_metrics_in_its_pod(overlay, tmp_path):
    """The exporter reads the engine's /metrics (its state, for the verdict's cause) from
    the server container beside it: loopback, the server's own port (not the tap's,
    which fronts the Service) and the flags that make the server publish it."""
    docs = render(overlay)
    dep, side = exporter_container(docs)
    cfg = serve_config(*localised(docs, side, tmp_path))
    engine, server = _server(dep)
    url = urlsplit(cfg.model_flags.engine_metrics_url)
    assert (url.scheme, url.hostname, url.path) == ("http", "localhost", "/metrics"), url
    assert url.port == ports(server)["http"] == _listen_port(server)
    # the URL belongs to the configured model, so its verdict reads that engine's state
    (model,) = cfg.model_options()
    assert model.engine_metrics_url == cfg.model_flags.engine_metrics_url
    if TAPPED[overlay]:
        assert url.port not in ports(container(dep, TAP)).values()
    for flag in ENGINE_METRICS_FLAGS[engine]:
        assert flag in server["args"], (engine, flag)


def _engine_service(docs, deployment: dict) -> dict:
    """The Service that selects the server's pods."""
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    (service,) = [s for s in of_kind(docs, "Service")
                  if s["spec"]["selector"].items() <= labels.items()]
    return service


def test_every_sidecar_overlay_says_whether_it_has_the_tap():
    assert sorted(TAPPED) == SIDECAR_OVERLAYS


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_the_service_port_reaches_the_tap_where_there_is_one(overlay):
    docs = render(overlay)
    dep, side = exporter_container(docs)
    _, server = _server(dep)
    service = _engine_service(docs, dep)
    by_name = {p["name"]: p for p in service["spec"]["ports"]}
    # Clients keep the server's port, with or without the tap.
    assert by_name["http"]["port"] == ports(server)["http"]
    names = {c["name"] for c in dep["spec"]["template"]["spec"]["containers"]}
    if not TAPPED[overlay]:
        assert TAP not in names and by_name["http"]["targetPort"] == "http"
        assert "PHASEWATCH_SOURCE_LABEL" not in env_values(side)
        return
    assert TAP in names and by_name["http"]["targetPort"] == "http-tap"
    # No port of the Service reaches the server past the tap.
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert not targets & {"http", ports(server)["http"]}
    # The tap's port is the pod's own: no name or number shared with another container.
    pod_ports = [p for c in dep["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])]
    assert len({p["name"] for p in pod_ports}) == len(pod_ports)
    assert len({p["containerPort"] for p in pod_ports}) == len(pod_ports)


@pytest.mark.parametrize("overlay", TAP_OVERLAYS)
def test_the_tap_fronts_the_server(overlay, tmp_path):
    docs = render(overlay)
    dep, side = exporter_container(docs)
    engine, server = _server(dep)
    tap = container(dep, TAP)
    cfg = serve_config(*localised(docs, side, tmp_path))
    args = build_parser().parse_args(tap["args"])
    assert tap["args"][0] == "tap" and args.func.__name__ == "cmd_tap"
    upstream = urlsplit(args.upstream)
    # Forwards to the server's own port on the pod's loopback ...
    assert (upstream.scheme, upstream.hostname, upstream.port) == (
        "http", "127.0.0.1", ports(server)["http"])
    # ... serves the Service's target port on the pod's address ...
    assert args.host == "0.0.0.0" and ports(tap) == {"http-tap": args.port}
    # ... records under the server's engine label, to the sidecar's phasewatch gRPC port.
    assert args.engine == ENGINE_LABELS[engine]
    assert args.target == f"{cfg.grpc_host}:{cfg.grpc_port}"
    assert tap["image"] == side["image"]
    # Ready when the server's own health path answers through the tap; alive on its socket.
    assert tap["readinessProbe"]["httpGet"] == {
        "path": server["readinessProbe"]["httpGet"]["path"], "port": "http-tap"}
    assert tap["readinessProbe"]["timeoutSeconds"] >= server["readinessProbe"].get(
        "timeoutSeconds", 1)
    assert tap["livenessProbe"]["tcpSocket"] == {"port": "http-tap"}
    hardened(tap)
    assert tap["securityContext"] == side["securityContext"]
    (tmp,) = [m for m in tap["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert tmp["name"] in {v["name"] for v in dep["spec"]["template"]["spec"]["volumes"]}
    # The sidecar labels every series with its source and waits for the other half
    # longer than the servers' OpenTelemetry batch exporters wait (5 s by default).
    env = env_values(side)
    assert env["PHASEWATCH_SOURCE_LABEL"] == "true"
    assert float(env["PHASEWATCH_TRACE_JOIN_WAIT"]) > 5
    for name, want in (("source_label", True),
                       ("trace_join_wait", float(env["PHASEWATCH_TRACE_JOIN_WAIT"]))):
        if hasattr(cfg, name):  # read as meant once the exporter has the setting
            assert getattr(cfg, name) == want, name


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_readiness_probes_wait_for_the_servers_health_answer(overlay):
    dep, _ = exporter_container(render(overlay))
    engine, server = _server(dep)
    probes = [server["readinessProbe"]]
    if TAPPED[overlay]:
        probes.append(container(dep, TAP)["readinessProbe"])
    for probe in probes:
        assert probe["httpGet"]["path"] == "/health"
        assert probe.get("timeoutSeconds", 1) > HEALTH_ANSWER_S.get(engine, 0), probe


class _Health(http.server.BaseHTTPRequestHandler):
    """A server's health endpoint answering the status its server holds."""

    def do_GET(self):
        self.send_response(self.server.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_):
        pass


def _status(port: int, path: str) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _moved(args: list[str], values: dict[str, str]) -> list[str]:
    """``args`` with the value after each flag in ``values`` replaced."""
    out = list(args)
    for flag, value in values.items():
        out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize("overlay", TAP_OVERLAYS)
def test_tap_started_as_the_manifest_says_is_ready_when_the_server_is(overlay, tmp_path):
    """`phasewatch tap` with the container's args (the server and the tap moved to free
    ports on 127.0.0.1) answers its readiness probe with what the server answers: not
    ready while the server loads, ready when it is, not ready when it is gone."""
    docs = render(overlay)
    dep, _ = exporter_container(docs)
    tap = container(dep, TAP)
    path = tap["readinessProbe"]["httpGet"]["path"]
    fake = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    fake.status = 503  # still loading its weights
    threading.Thread(target=fake.serve_forever, daemon=True).start()
    args = _moved(tap["args"], {"--upstream": f"http://127.0.0.1:{fake.server_port}",
                                "--host": "127.0.0.1", "--port": "0"})
    log = tmp_path / "tap.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", *args], cwd=tmp_path,
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        found = wait_for(lambda: re.search(r"tap on http://127\.0\.0\.1:(\d+)",
                                           log.read_text()), timeout=30)
        assert found, log.read_text()
        port = int(found[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the liveness probe
        assert _status(port, path) == 503
        fake.status = 200
        assert _status(port, path) == 200
        fake.shutdown()
        fake.server_close()
        assert _status(port, path) == 502
    finally:
        terminate(proc)
        fake.shutdown()
        fake.server_close()


def test_gateway_receives_what_the_servers_send(tmp_path):
    docs = render("gateway")
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    gateway = container(deployments["phasewatch-gateway"], "phasewatch")
    cfg = serve_config(*localised(docs, gateway, tmp_path))
    assert cfg.pod_label and cfg.otlp_grpc_host == "0.0.0.0"
    assert {m.served_model_name for m in cfg.models} >= {"meta-llama/Llama-3.1-8B-Instruct"}
    (service,) = [s for s in of_kind(docs, "Service")
                  if s["metadata"]["name"] == "phasewatch-gateway"]
    by_port = {p["port"]: p["targetPort"] for p in service["spec"]["ports"]}
    engine, server = _server(deployments["vllm-llama"])
    host, port = _otlp_endpoint(server, engine)
    assert host == "phasewatch-gateway" and ports(gateway)[by_port[port]] == cfg.otlp_grpc_port
    env = {e["name"]: e for e in server["env"]}
    assert env["OTEL_RESOURCE_ATTRIBUTES"]["value"] == "k8s.pod.name=$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    # A central exporter cannot reach every replica's /metrics: its cause comes from the
    # records, and nothing points it at one pod's engine.
    assert not cfg.model_flags.engine_metrics_url
    assert not any(m.engine_metrics_url for m in cfg.models)
    # The service name the server sets maps to a configured model.
    mapped = dict(p.split("=") for p in cfg.otlp_model_map.split(","))
    assert mapped[env["OTEL_SERVICE_NAME"]["value"]] in {m.served_model_name
                                                         for m in cfg.models}


@pytest.mark.parametrize("overlay", [*SIDECAR_OVERLAYS, "gateway"])
def test_exporter_started_as_the_manifest_says_answers_its_probes(overlay, tmp_path):
    """`phasewatch serve` with the container's args and env (ports moved to free ones,
    as two overlays cannot share 9464 on one test machine) passes its own probes."""
    docs = render(overlay)
    _, side = exporter_container(docs)
    args, manifest_env = localised(docs, side, tmp_path)
    env = {**os.environ, **manifest_env}
    env.update({f"PHASEWATCH_{k}_PORT": "0" for k in ("HTTP", "GRPC", "OTLP_GRPC", "OTLP_HTTP")})
    env["PHASEWATCH_HTTP_HOST"] = "127.0.0.1"
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", *args], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        port, lines = None, []
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
            port = int(m[1]) if m else None
        assert port, "".join(lines)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            path = side[probe]["httpGet"]["path"]
            status = None
            while time.monotonic() < deadline and status != 200:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                        status = r.status
                except OSError:
                    time.sleep(0.2)
            assert status == 200, f"{probe} {path}"
    finally:
        terminate(proc)
