"""The Kubernetes manifests: every overlay renders with ``kubectl kustomize``, validates
against the Kubernetes schemas, and agrees with what the exporter actually serves:
container ports and probes are the exporter's configured ports and endpoints, the
inference server's OTLP flag points at the sidecar's OTLP/gRPC receiver, the sidecar
scrapes the server's own /metrics on its port in the pod (with the flags that publish
what it reads), and the exporter started with the container's own arguments and
environment answers its probes. Where the tap is deployed, it fronts the server (its
--upstream is the server's port, the Service's port reaches the tap) and, started with
its own arguments, is ready exactly when the server answers through it.

What a new user runs works as printed on a plain cluster: the phasewatch image is the
one `make image` tags (no placeholder registry); nothing in the default overlays needs
the Prometheus Operator (its PodMonitor, ServiceMonitor and PrometheusRule are the
opt-in deploy/kubernetes/monitoring) and the pods carry the prometheus.io/* annotations
of the exporter's real port; the example servers run pinned releases of an ungated
model, which is the model phasewatch is configured with, and a Hugging Face token only
from an optional Secret; and examples/existing-vllm adds the sidecar to a Deployment the
user already runs, keeping all of theirs."""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from phasewatch.cli import build_parser
from phasewatch.config import load_serve_config
from phasewatch.ingest.adapters import sglang as sglang_adapter
from phasewatch.ingest.adapters import tgi as tgi_adapter
from phasewatch.ingest.adapters import vllm as vllm_adapter
from phasewatch.roofline import catalog
from phasewatch.roofline.deployments import resolve
from tests.conftest import require_binary, terminate, wait_for
from tests.support import ROOT

K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
# The central overlay: the OpenTelemetry Collector in front of phasewatch replicas
# (tests/deploy/test_kubernetes_fleet.py); every other overlay is a server with its sidecar.
FLEET = "gateway"
SIDECAR_OVERLAYS = [o for o in OVERLAYS if o != FLEET]
# Copy-paste examples (examples/<name>): phasewatch added to a Deployment the user runs.
EXAMPLES = sorted(f"examples/{p.name}" for p in (K8S / "examples").iterdir())
# Everything with a phasewatch sidecar beside a server.
SIDECARS = [*SIDECAR_OVERLAYS, *EXAMPLES]
# The Prometheus Operator's resources: opt-in, applied beside an overlay or an example.
OPERATOR_PIECE = "monitoring"
OPERATOR_API = "monitoring.coreos.com/"
# The oldest Kubernetes still in common support, and the newest the schemas know.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
OPERATOR_KINDS = {"PodMonitor", "ServiceMonitor", "PrometheusRule"}
# Their CRDs' schemas, as the Operator ships them (tests/fixtures/prometheus-operator).
OPERATOR_CRDS = json.loads((ROOT / "tests" / "fixtures" / "prometheus-operator" /
                            "crd-schemas.json").read_text())
# How each server is told where to send OTLP: (container, flag).
OTLP_FLAGS = {"vllm": "--otlp-traces-endpoint", "tgi": "--otlp-endpoint",
              "sglang": "--otlp-traces-endpoint"}
# Which server a container runs, by its image (a user's container has its own name).
ENGINE_IMAGES = {"vllm/vllm-openai": "vllm", "lmsysorg/sglang": "sglang",
                 "ghcr.io/huggingface/text-generation-inference": "tgi"}
# Where each server listens without --port (vLLM 8000, SGLang 30000, TGI's launcher 3000).
DEFAULT_PORTS = {"vllm": 8000, "sglang": 30000, "tgi": 3000}
# How each server is told its model: vLLM's first positional argument or --model.
MODEL_FLAGS = {"vllm": "--model", "sglang": "--model-path", "tgi": "--model-id"}
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
def render(target: str) -> tuple[dict, ...]:
    """``kubectl kustomize`` of an overlay's name, or of a path under deploy/kubernetes."""
    kubectl = require_binary("kubectl", "it renders the kustomize overlays")
    path = K8S / target if "/" in target or target == OPERATOR_PIECE else K8S / "overlays" / target
    r = subprocess.run([kubectl, "kustomize", str(path)],
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


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES, OPERATOR_PIECE])
def test_overlay_renders_and_validates(target):
    docs = render(target)
    kinds = {d["kind"] for d in docs}
    if target == OPERATOR_PIECE:
        assert kinds == OPERATOR_KINDS
    elif target in EXAMPLES:
        assert "Deployment" in kinds
    else:
        assert {"Namespace", "Deployment", "Service"} <= kinds
    for doc in docs:
        if doc["kind"] in OPERATOR_KINDS:
            errors = operator_errors(doc)
            assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: {errors}"
            continue
        for version in VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: "
                            f"{e.message} at {'/'.join(map(str, e.path))}")


def _strict(schema):
    """A CRD schema that refuses unknown fields, as `kubectl apply` does (strict field
    validation, its default since 1.27): every object with properties and no rule for
    others gets ``additionalProperties: false``."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items()}
    if ("properties" in schema and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def operator_errors(doc: dict) -> list[str]:
    """What the Operator's CRD schema of the document's kind says against it."""
    schema = _strict(OPERATOR_CRDS["kinds"][doc["kind"]])
    return sorted(f"{'/'.join(map(str, e.path))}: {e.message}"
                  for e in jsonschema.Draft7Validator(schema).iter_errors(doc))


def test_the_monitors_scrape_the_native_histograms_and_keep_the_classic_ones():
    """Prometheus 3.9+ reads native histograms only where a scrape job says so: the
    monitors set the Operator's fields for it (its v0.88.0+ CRDs; the Operator writes
    scrape_native_histograms for Prometheus 3.8+ and always_scrape_classic_histograms, on
    2.45+ scrape_classic_histograms), and the CRD schemas know them: a misspelt field is
    refused, so the validation above is not vacuous."""
    assert OPERATOR_CRDS["source"].startswith(
        "github.com/prometheus-operator/prometheus-operator v0.")
    monitors = [d for d in render(OPERATOR_PIECE) if d["kind"] in ("PodMonitor",
                                                                   "ServiceMonitor")]
    assert len(monitors) == 2
    for monitor in monitors:
        assert monitor["spec"]["scrapeNativeHistograms"] is True, monitor["metadata"]
        assert monitor["spec"]["scrapeClassicHistograms"] is True, monitor["metadata"]
        assert not operator_errors(monitor)
        misspelt = {**monitor, "spec": {**monitor["spec"], "scrapeNativeHistogram": True}}
        assert any("scrapeNativeHistogram" in e for e in operator_errors(misspelt))
        wrong_type = {**monitor, "spec": {**monitor["spec"], "scrapeNativeHistograms": "yes"}}
        assert any("scrapeNativeHistograms" in e for e in operator_errors(wrong_type))


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_nothing_but_the_opt_in_piece_needs_the_prometheus_operator(target):
    """`kubectl apply -k` of an overlay or an example works on a cluster without the
    Operator's CRDs; everything of the Operator's is in the opt-in piece."""
    needs = [f"{d['kind']}/{d['metadata']['name']}" for d in render(target)
             if d["apiVersion"].startswith(OPERATOR_API)]
    assert not needs, f"{target} needs the Prometheus Operator's CRDs for {needs}"
    assert all(d["apiVersion"].startswith(OPERATOR_API) for d in render(OPERATOR_PIECE))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_creates_the_namespace_it_deploys_into(overlay):
    """No "namespaces not found" on a fresh cluster: the overlay brings its namespace."""
    docs = render(overlay)
    (namespace,) = of_kind(docs, "Namespace")
    name = namespace["metadata"]["name"]
    assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {name}


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_operator_resources_select_what_exists(target):
    """The opt-in monitors, applied into the target's namespace (`kubectl apply -n NS -k
    deploy/kubernetes/monitoring`), scrape every exporter the target deploys, on a port
    its pods or Services have, under the job the alerts watch."""
    docs = render(target)
    operator = render(OPERATOR_PIECE)
    assert not any("namespace" in d["metadata"] for d in operator)  # -n decides
    pods = {d["metadata"]["name"]: d["spec"]["template"] for d in of_kind(docs, "Deployment")}
    scraped = set()
    for pm in of_kind(operator, "PodMonitor"):
        for name, p in pods.items():
            if not pm["spec"]["selector"]["matchLabels"].items() <= p["metadata"][
                    "labels"].items():
                continue
            names = {port.get("name") for c in p["spec"]["containers"]
                     for port in c.get("ports", [])}
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert ep["port"] in names and ep["path"] == "/metrics"
            scraped.add(name)
    for sm in of_kind(operator, "ServiceMonitor"):
        for s in of_kind(docs, "Service"):
            if not sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items():
                continue
            for ep in sm["spec"]["endpoints"]:
                assert ep["port"] in {p["name"] for p in s["spec"]["ports"]}
            scraped |= {name for name, p in pods.items()
                        if s["spec"]["selector"].items() <= p["metadata"]["labels"].items()}
    exporters = {name for name, p in pods.items() for c in p["spec"]["containers"]
                 if c["name"] == "phasewatch" and c["args"][0] == "serve"}
    assert exporters and exporters <= scraped, (exporters, scraped)
    for monitor in of_kind(operator, "PodMonitor") + of_kind(operator, "ServiceMonitor"):
        endpoints = (monitor["spec"].get("podMetricsEndpoints")
                     or monitor["spec"]["endpoints"])
        # The job the PhasewatchExporterDown alert watches.
        assert all({"targetLabel": "job", "replacement": "phasewatch"} in e["relabelings"]
                   for e in endpoints)


def test_the_opt_in_prometheus_rule_is_the_shipped_rules(tmp_path):
    """The PrometheusRule's groups are the rule files' groups, and promtool accepts them."""
    (rule,) = of_kind(render(OPERATOR_PIECE), "PrometheusRule")
    shipped = [g for f in sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"),
                                 reverse=True)
               for g in yaml.safe_load(f.read_text())["groups"]]
    assert rule["spec"]["groups"] == shipped
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    promtool = require_binary("promtool", "it checks the PrometheusRule's groups")
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def pod_templates(docs) -> list[dict]:
    return [d["spec"]["template"] for d in of_kind(docs, "Deployment")]


def exporters(docs) -> list[tuple[dict, dict]]:
    """(pod template, container) of every `phasewatch serve` in a render."""
    return [(p, c) for p in pod_templates(docs) for c in p["spec"]["containers"]
            if c["name"] == "phasewatch" and c["args"][0] == "serve"]


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_pods_ask_a_plain_prometheus_to_scrape_the_exporters_port(target, tmp_path):
    """Without the Operator, Prometheus's pod discovery finds the exporter by the
    prometheus.io/* annotations: they name the port and path it really serves."""
    docs = render(target)
    found = exporters(docs)
    assert found
    for pod, c in found:
        cfg = serve_config(*localised(docs, c, tmp_path))
        annotations = pod["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", annotations
        assert int(annotations["prometheus.io/port"]) == cfg.http_port == ports(c)[
            "phasewatch-http"]
        assert annotations["prometheus.io/path"] == "/metrics"
        assert cfg.http_host == "0.0.0.0"
    # A pod without an exporter asks for no scrape (its annotated port would be another's).
    for pod in pod_templates(docs):
        if not any(c["name"] == "phasewatch" for c in pod["spec"]["containers"]):
            assert "prometheus.io/scrape" not in pod["metadata"].get("annotations", {})


def _repo(image: str) -> str:
    """The image's name without its tag."""
    name, _, tag = image.rpartition(":")
    return name if name and "/" not in tag else image


def _tag(image: str) -> str | None:
    name, _, tag = image.rpartition(":")
    return tag if name and "/" not in tag else None


@functools.cache
def make_image_tag() -> str:
    """The tag `make image` gives the image it builds (make's own dry run)."""
    make = require_binary("make", "it reads the tag `make image` builds")
    r = subprocess.run([make, "-n", "-s", "image"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    (tag,) = re.findall(r"^docker build -t (\S+) \.$", r.stdout, re.M)
    return tag


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_phasewatch_runs_the_image_make_image_builds(target):
    """Nobody publishes the phasewatch image: every manifest runs the tag `make image`
    builds from the Dockerfile, pulled only if the node lacks it (loaded with kind or
    minikube), with a phasewatch command line that the image's entrypoint accepts."""
    tag = make_image_tag()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tag == f"phasewatch:{version}"
    ours = [c for p in pod_templates(render(target)) for c in p["spec"]["containers"]
            if _repo(c["image"]).rsplit("/", 1)[-1] == "phasewatch"]
    assert ours
    for c in ours:
        assert c["image"] == tag, (c["name"], c["image"])
        assert c["imagePullPolicy"] == "IfNotPresent", c["name"]
        build_parser().parse_args(c["args"])  # exits (SystemExit) on a command it lacks


def test_no_manifest_names_a_placeholder_registry():
    for path in sorted(K8S.rglob("*.yaml")):
        text = path.read_text()
        for placeholder in ("registry.example", "example.com", "example.org"):
            assert placeholder not in text, f"{path.relative_to(ROOT)}: {placeholder}"


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_every_image_is_a_pinned_release(target):
    """Never :latest (or no tag): a restart must not change what runs. The servers run
    released versions; every image comes from Docker Hub or ghcr.io, no placeholder."""
    for pod in pod_templates(render(target)):
        for c in pod["spec"]["containers"]:
            tag = _tag(c["image"])
            assert tag and tag != "latest", c["image"]
            repo = _repo(c["image"])
            first = repo.split("/", 1)[0] if "/" in repo else ""
            # Docker's rule: a first component with a dot or a port is a registry's host.
            host = first if "." in first or ":" in first or first == "localhost" else ""
            assert host in ("", "ghcr.io"), c["image"]
            if repo in ENGINE_IMAGES:
                assert re.fullmatch(r"v?\d+\.\d+\.\d+", tag), c["image"]
    for path in sorted(K8S.rglob("*.yaml")):
        assert not re.search(r"image:\s*\S+:latest\b", path.read_text()), path


TOKEN_VARIABLES = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")


def documented_token_secret() -> tuple[str, str]:
    """(Secret name, key) of the one `kubectl create secret` command the docs print."""
    found = set()
    for doc in (ROOT / "docs" / "deploy.md", ROOT / "README.md"):
        found |= set(re.findall(r"kubectl\s+(?:-n\s+\S+\s+)?create\s+secret\s+generic\s+"
                                r"(\S+)\s+--from-literal=([\w.-]+)=", doc.read_text()))
    assert len(found) == 1, found
    return found.pop()


@pytest.mark.parametrize("target", [*OVERLAYS, *EXAMPLES])
def test_a_hugging_face_token_is_optional(target):
    """Every token comes from the Secret the docs create, and is optional: a pod of an
    ungated model starts without it."""
    secret = documented_token_secret()
    for pod in pod_templates(render(target)):
        for c in pod["spec"]["containers"]:
            refs = [e for e in c.get("env", []) if e["name"] in TOKEN_VARIABLES]
            for e in refs:
                ref = e["valueFrom"]["secretKeyRef"]
                assert ref["optional"] is True, (c["name"], e)
                assert (ref["name"], ref["key"]) == secret, (c["name"], e)
            # The example servers take it (a user's own Deployment keeps what it has).
            if target in OVERLAYS and _repo(c["image"]) in ENGINE_IMAGES:
                assert [e["name"] for e in refs] == ["HF_TOKEN"], c["name"]


@pytest.mark.parametrize("overlay", SIDECAR_OVERLAYS)
def test_the_dashboard_reads_an_exporter_its_overlay_deploys(overlay, tmp_path):
    """The in-cluster dashboard needs no Prometheus: its --exporter URL is a Service of
    the overlay whose port reaches an exporter's HTTP port; the dashboard's own Service
    reaches the port it serves on."""
    docs = render(overlay)
    deployments = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment")}
    dash = container(deployments["phasewatch-dashboard"], "dashboard")
    args = build_parser().parse_args(dash["args"])
    assert args.command == "dashboard" and args.host == "0.0.0.0"
    assert ports(dash) == {"dashboard": args.port}
    services = {s["metadata"]["name"]: s for s in of_kind(docs, "Service")}
    assert {p["targetPort"] for p in services["phasewatch-dashboard"]["spec"]["ports"]} == {
        "dashboard"}
    url = urlsplit(args.exporter)
    service = services[url.hostname]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == url.port]
    reached = [(p, c) for p, c in exporters(docs)
               if service["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
    assert reached, f"{url.hostname} selects no exporter"
    for _, c in reached:
        cfg = serve_config(*localised(docs, c, tmp_path))
        assert ports(c)[port["targetPort"]] == cfg.http_port


def _server(deployment: dict) -> tuple[str, dict]:
    """(engine, container) of the inference server in a pod, known by its image."""
    (found,) = [(ENGINE_IMAGES[_repo(c["image"])], c)
                for c in deployment["spec"]["template"]["spec"]["containers"]
                if _repo(c["image"]) in ENGINE_IMAGES]
    return found


def _arg(c: dict, flag: str) -> str | None:
    """The value of ``flag`` in a container's args, spelt ``--flag=V`` or ``--flag V``."""
    args = c.get("args", [])
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    values += [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    assert len(values) <= 1, (flag, args)
    return values[0] if values else None


def _engine_model(engine: str, c: dict) -> str:
    """The model a server is told to load: vLLM's positional argument or --model."""
    model = _arg(c, MODEL_FLAGS[engine])
    if model is None and engine == "vllm" and not c["args"][0].startswith("-"):
        model = c["args"][0]
    assert model, (engine, c["args"])
    return model


def _otlp_endpoint(c: dict, engine: str) -> tuple[str, int]:
    value = _arg(c, OTLP_FLAGS[engine])
    url = urlsplit(value if "://" in value else "grpc://" + value)
    return url.hostname, url.port


@pytest.mark.parametrize("target", SIDECARS)
def test_sidecar_matches_what_the_exporter_serves(target, tmp_path):
    docs = render(target)
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
    # The sidecar's settings are its container's own: the server's pod keeps its own.
    assert "securityContext" not in dep["spec"]["template"]["spec"]


@pytest.mark.parametrize("target", SIDECARS)
def test_phasewatch_is_told_the_model_the_server_serves(target, tmp_path):
    """The sidecar's model resolves in phasewatch's catalog to the model the server
    loads, under the name the server serves it as (what its requests and /metrics
    carry)."""
    docs = render(target)
    dep, side = exporter_container(docs)
    engine, server = _server(dep)
    (options,) = serve_config(*localised(docs, side, tmp_path)).model_options()
    deployment = resolve(options)
    model = _engine_model(engine, server)
    assert deployment.model_source == "catalog"
    assert deployment.model.name == catalog.model(model).name, (options.model, model)
    assert deployment.served_name == (_arg(server, "--served-model-name") or model)


def _listen_port(engine: str, c: dict) -> int:
    """The port the server listens on: its ``--port``, else the server's default."""
    return int(_arg(c, "--port") or DEFAULT_PORTS[engine])


@pytest.mark.parametrize("target", SIDECARS)
def test_sidecar_scrapes_the_engines_own_metrics_in_its_pod(target, tmp_path):
    """The exporter reads the engine's /metrics (its state, for the verdict's cause) from
    the server container beside it: loopback, the server's own port (not the tap's,
    which fronts the Service) and the flags that make the server publish it."""
    docs = render(target)
    dep, side = exporter_container(docs)
    cfg = serve_config(*localised(docs, side, tmp_path))
    engine, server = _server(dep)
    url = urlsplit(cfg.model_flags.engine_metrics_url)
    assert (url.scheme, url.hostname, url.path) == ("http", "localhost", "/metrics"), url
    assert url.port == _listen_port(engine, server)
    assert url.port in {p["containerPort"] for p in server["ports"]}
    # the URL belongs to the configured model, so its verdict reads that engine's state
    (model,) = cfg.model_options()
    assert model.engine_metrics_url == cfg.model_flags.engine_metrics_url
    if TAPPED.get(target):
        assert url.port not in ports(container(dep, TAP)).values()
    if target in SIDECAR_OVERLAYS:  # a user's own server keeps its flags
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


def workers_follow_the_cpu_request(tap: dict) -> int:
    """The tap container runs one worker per core it requests (issue 30): the CLI's
    ``--workers`` default comes from ``PHASEWATCH_TAP_WORKERS``, which Kubernetes sets
    from the container's own CPU request, rounded up (a resourceFieldRef with divisor
    1). The number of workers, as the CLI reads it in that container."""
    import math

    env = {e["name"]: e for e in tap.get("env", [])}
    ref = env["PHASEWATCH_TAP_WORKERS"]["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": tap["name"], "resource": "requests.cpu",
                   "divisor": "1"}, ref
    cpu = str(tap["resources"]["requests"]["cpu"])
    cores = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    want = math.ceil(cores)  # as the kubelet rounds a resourceFieldRef
    read = subprocess.run(
        [sys.executable, "-c", "import sys; from phasewatch.cli import build_parser; "
         "print(build_parser().parse_args(sys.argv[1:]).workers)", *tap["args"]],
        env={**os.environ, "PHASEWATCH_TAP_WORKERS": str(want)}, capture_output=True,
        text=True, timeout=60)
    assert read.stdout.strip() == str(want), read.stderr
    assert "--workers" not in " ".join(tap["args"])  # the request decides, not a flag
    return want


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
    workers_follow_the_cpu_request(tap)
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
        proc = subprocess.Popen([sys.executable, "-m", "phasewatch.cli", *args], cwd=tmp_path,
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


@pytest.mark.parametrize("target", [*SIDECARS, FLEET])
def test_exporter_started_as_the_manifest_says_answers_its_probes(target, tmp_path):
    """`phasewatch serve` with the container's args and env (ports moved to free ones,
    as two overlays cannot share 9464 on one test machine) passes its own probes and
    serves its metrics on the path its pod's prometheus.io/path annotation names."""
    docs = render(target)
    dep, side = exporter_container(docs)
    args, manifest_env = localised(docs, side, tmp_path)
    env = {**os.environ, **manifest_env}
    env.update({f"PHASEWATCH_{k}_PORT": "0" for k in ("HTTP", "GRPC", "OTLP_GRPC", "OTLP_HTTP")})
    env["PHASEWATCH_HTTP_HOST"] = "127.0.0.1"
    proc = subprocess.Popen([sys.executable, "-m", "phasewatch.cli", *args], env=env, cwd=tmp_path,
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
        path = dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            assert r.status == 200 and "# TYPE " in r.read().decode()
    finally:
        terminate(proc)


def _users_deployment(example: str) -> dict:
    """The Deployment the user already runs: the example's own resource file."""
    kustomization = yaml.safe_load((K8S / example / "kustomization.yaml").read_text())
    docs = [d for f in kustomization["resources"]
            for d in yaml.safe_load_all((K8S / example / f).read_text()) if d]
    (deployment,) = of_kind(docs, "Deployment")
    return deployment


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_existing_deployment_keeps_everything_of_its_own(example):
    """phasewatch added to a Deployment the user runs, named and configured their way
    (a container not called `vllm`, its own arguments, env, ports, probes and volumes):
    all of it is as it was; the server gets the one OTLP flag the overlays give it,
    appended; the pod gains the sidecar, the label and annotations, and `kubectl logs`
    still picks the server."""
    mine = _users_deployment(example)
    (rendered,) = [d for d in of_kind(render(example), "Deployment")
                   if d["metadata"]["name"] == mine["metadata"]["name"]]
    engine, before = _server(mine)
    _, after = _server(rendered)
    dep, _ = exporter_container(render(engine))
    _, ours = _server(dep)
    assert before["name"] != ours["name"]
    # The OTLP flag, spelt as the overlay of the same server spells it.
    (flag,) = [a for a in ours["args"] if a.startswith(OTLP_FLAGS[engine] + "=")]
    assert after == {**before, "args": [*before["args"], flag]}
    theirs, now = mine["spec"]["template"], rendered["spec"]["template"]
    assert {c["name"] for c in now["spec"]["containers"]} == {
        c["name"] for c in theirs["spec"]["containers"]} | {"phasewatch"}
    for c in theirs["spec"]["containers"]:
        if c["name"] != before["name"]:
            assert container(rendered, c["name"]) == c
    # Pod settings: theirs, plus the sidecar's scratch volume.
    for key, value in theirs["spec"].items():
        if key == "volumes":
            assert all(v in now["spec"]["volumes"] for v in value)
        elif key != "containers":
            assert now["spec"][key] == value, key
    assert set(now["spec"]) <= set(theirs["spec"]) | {"volumes"}
    assert {k: v for k, v in rendered["spec"].items() if k != "template"} == {
        k: v for k, v in mine["spec"].items() if k != "template"}
    # Labels and annotations: theirs, plus phasewatch's.
    for part in ("labels", "annotations"):
        assert theirs["metadata"].get(part, {}).items() <= now["metadata"][part].items()
    assert now["metadata"]["labels"]["phasewatch.dev/sidecar"] == "enabled"
    assert now["metadata"]["annotations"]["kubectl.kubernetes.io/default-container"] == before[
        "name"]
