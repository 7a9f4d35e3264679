"""The Kubernetes manifests: every overlay renders with ``kubectl kustomize``, validates
against the Kubernetes schemas, and agrees with what the exporter actually serves:
container ports and probes are the exporter's configured ports and endpoints, the
inference server's OTLP flag points at the sidecar's OTLP/gRPC receiver, and the
exporter started with the container's own arguments and environment answers its
probes."""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from exporter.cli import build_parser
from exporter.config import load_serve_config
from tests.conftest import require_binary, terminate

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
            if c["name"] != "phasewatch"]
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
    security = side["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert not security["allowPrivilegeEscalation"] and security["capabilities"]["drop"] == [
        "ALL"]
    assert side["resources"]["requests"] and side["resources"]["limits"]


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
