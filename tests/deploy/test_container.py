"""The Dockerfile and deploy/docker-compose.yml, as far as a machine without a Docker
engine can check them: hadolint lints the Dockerfile; docker-compose validates the
compose file against the Compose schema (`config` needs no engine); the package the
image installs carries everything the commands need; and every command, port,
address and mount in the compose file is one the exporter, the simulator, the
dashboard, Prometheus (`promtool check config`) and Grafana's provisioning accept."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from phasewatch.cli import build_parser
from phasewatch.config import load_serve_config
from tests.conftest import require_binary
from tests.support import ROOT
from tests.support.prom import NATIVE_SCRAPE_KEYS, native_by_config

COMPOSE = ROOT / "deploy" / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [(m[1].upper(), m[2].strip()) for line in text.splitlines()
            if (m := re.match(r"^\s*([A-Za-z]+)\s+(.*)$", line)) and not line.lstrip()
            .startswith("#")]


@pytest.fixture(scope="module")
def compose() -> dict:
    """The compose file as docker-compose resolves it (anchors merged, paths absolute)."""
    docker_compose = require_binary("docker-compose", "it validates deploy/docker-compose.yml")
    r = subprocess.run([docker_compose, "-f", str(COMPOSE), "config"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_hadolint_passes_on_the_dockerfile():
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        hadolint = Path(require_binary("hadolint", "it lints the Dockerfile"))
    r = subprocess.run([str(hadolint), "--failure-threshold", "info", str(DOCKERFILE)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_copies_what_exists_and_runs_phasewatch_as_non_root():
    steps = _instructions()
    for op, args in steps:
        if op == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such path"
    assert ("ENTRYPOINT", '["phasewatch"]') in steps
    (user,) = [a for op, a in steps if op == "USER"]
    assert not user.startswith(("0", "root"))
    (expose,) = [a for op, a in steps if op == "EXPOSE"]
    defaults = load_serve_config(None, {})
    tap = build_parser().parse_args(["tap", "--upstream", "http://127.0.0.1:8000"])
    assert {int(p) for p in expose.split()} == {
        defaults.otlp_grpc_port, defaults.otlp_http_port, defaults.grpc_port,
        defaults.http_port, 8050, tap.port}


def test_the_package_the_image_installs_carries_everything(tmp_path):
    """`pip install .` in the Dockerfile: the wheel holds one import name, `phasewatch`
    (exporter/ and dashboard/ under it), the catalog data and the generated protocol
    code, and installs the `phasewatch` command."""
    # what the Dockerfile copies, built apart (setuptools leaves build/ in its source
    # tree, and a stale one would add its files to the wheel)
    src = tmp_path / "src"
    for name in ("pyproject.toml", "README.md"):
        src.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, src / name)
    for folder in ("exporter", "dashboard"):
        shutil.copytree(ROOT / folder, src / folder,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp_path), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("phasewatch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ("phasewatch/cli.py", "phasewatch/roofline/catalog/models.json",
                     "phasewatch/roofline/catalog/hardware.json",
                     "phasewatch/protocol/phasewatch_pb2.py", "phasewatch/dashboard/app.py",
                     "phasewatch/sim/scenarios.py"):
        assert required in names, required
    # no generic top-level name (exporter, dashboard) to collide with a user's own
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"phasewatch"}
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "phasewatch = phasewatch.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _argv(service: dict) -> list[str]:
    command = service["command"]
    return command if isinstance(command, list) else command.split()


def _mounts(service: dict) -> dict[str, Path]:
    """Container path -> host path of a service's bind mounts (docker-compose prints
    them as "source:target[:mode]"; the Compose spec also allows the long form)."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *_ = v.split(":")
        else:
            source, target = v.get("source", ""), v["target"]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def test_compose_services_agree_with_the_exporter(compose, tmp_path):
    services = compose["services"]
    assert {"exporter", "simulator", "prometheus", "dashboard"} <= set(services)
    exporter = services["exporter"]
    ns = build_parser().parse_args(_argv(exporter))
    cfg = load_serve_config(ns, {k: str(v) for k, v in exporter["environment"].items()})
    published = {int(p["target"]) for p in exporter["ports"]}
    assert published == {cfg.http_port, cfg.otlp_grpc_port, cfg.otlp_http_port, cfg.grpc_port}
    # Other containers send to it: the receivers listen beyond loopback.
    assert cfg.grpc_host == cfg.otlp_grpc_host == cfg.otlp_http_host == "0.0.0.0"
    assert f":{cfg.http_port}/readyz" in " ".join(exporter["healthcheck"]["test"])
    sim = build_parser().parse_args(_argv(services["simulator"]))
    assert sim.command == "simulate" and sim.target == f"exporter:{cfg.grpc_port}"
    dash = build_parser().parse_args(_argv(services["dashboard"]))
    assert dash.command == "dashboard" and dash.host == "0.0.0.0"
    assert urlsplit(dash.exporter).netloc == f"exporter:{cfg.http_port}"
    assert {int(p["target"]) for p in services["dashboard"]["ports"]} == {dash.port}
    for name in ("exporter", "simulator", "dashboard"):
        s = services[name]
        assert s["read_only"] and s["cap_drop"] == ["ALL"], name

    # Prometheus: its config (with the mounted paths mapped back to the repository)
    # passes promtool, scrapes the exporter's port and loads every rule file.
    prom = services["prometheus"]
    mounts = _mounts(prom)
    config_path = next(t for t in mounts if t.endswith("prometheus.yml"))
    config = yaml.safe_load(mounts[config_path].read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == [
        f"exporter:{cfg.http_port}"]
    local = []
    for pattern in config["rule_files"]:
        directory = next(t for t in mounts if pattern.startswith(t + "/"))
        local.append(str(mounts[directory]) + pattern[len(directory):])
    config["rule_files"] = local
    assert sorted(p for g in local for p in Path("/").glob(g.lstrip("/"))) == sorted(
        (ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
    # A current Prometheus 3, pinned, reading the native histograms by its config.
    image, _, tag = prom["image"].partition(":")
    assert image == "prom/prometheus" and re.fullmatch(r"v3\.\d+\.\d+", tag), prom["image"]
    assert tuple(map(int, tag[1:].split("."))) >= (3, 8, 0), tag
    assert not any("native-histograms" in arg for arg in _argv(prom)), _argv(prom)
    check_prometheus_config(config, tmp_path)


def check_prometheus_config(config: dict, tmp_path: Path) -> None:
    """Every scrape job of a Prometheus 3 config reads native histograms and keeps classic
    buckets (``NATIVE_SCRAPE_KEYS``), and `promtool check config` accepts it. Debian's
    promtool is 2.x, which refuses those keys (2.x config parsing is strict): there it
    must say so, and accept the config with them taken out, as docs/deploy.md tells
    2.x users to do."""
    promtool = require_binary("promtool", "it checks the Prometheus configs")
    for job in config["scrape_configs"]:
        assert {k: job.get(k) for k in NATIVE_SCRAPE_KEYS} == NATIVE_SCRAPE_KEYS, job
    two = {**config, "scrape_configs": [{k: v for k, v in job.items()
                                         if k not in NATIVE_SCRAPE_KEYS}
                                        for job in config["scrape_configs"]]}
    for name, cfg, ok in (("as-shipped", config, native_by_config(promtool)),
                          ("for-2.x", two, True)):
        path = tmp_path / f"prometheus-{name}.yml"
        path.write_text(yaml.safe_dump(cfg))
        r = subprocess.run([promtool, "check", "config", str(path)], capture_output=True,
                           text=True)
        assert (r.returncode == 0) == ok, (name, r.stdout + r.stderr)
        if not ok:  # 2.x: the first 3.x key is what it stops at
            assert "field scrape_native_histograms not found" in r.stdout + r.stderr, r


def test_the_local_prometheus_config_is_a_prometheus_3_config(tmp_path):
    """deploy/prometheus/prometheus.yml (a Prometheus beside `phasewatch serve`) as the
    compose one: native histograms by the scrape job, promtool-checked."""
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == [
        f"127.0.0.1:{load_serve_config(None, {}).http_port}"]
    check_prometheus_config(config, tmp_path)


def test_compose_grafana_mounts_what_provisioning_expects(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = mounts["/etc/grafana/provisioning"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "phasewatch.yml").read_text())[
        "providers"]
    dashboards = mounts[provider["options"]["path"]]
    assert (dashboards / "phasewatch.json").exists()
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/phasewatch.json"
