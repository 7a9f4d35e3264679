"""Scaling out: two exporter replicas behind one Prometheus give the same cluster-wide
quantiles as one exporter that saw all of the load (docs/deploy.md, "Scaling to a cluster").

Two simulated servers ("pods") each send their finished requests to their own
replica (A or B), as a gateway sharded by pod or two sidecars would get them; a third
exporter (C) gets both pods' requests. A real Prometheus scrapes all three. Every
phasewatch histogram has fixed bucket bounds, so bucket counts add up across
replicas: ``histogram_quantile(q, sum by (le) (...))`` over A and B must equal the one
over C exactly, for TTFT, ITL, TPOT, e2e and each phase.
"""

from __future__ import annotations

import time

import pytest

from phasewatch.app import Exporter
from phasewatch.client import PhasewatchClient
from phasewatch.config import ServeConfig
from phasewatch.sim.scenarios import scenario
from tests.support.prom import PrometheusServer

PORTS = dict(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
             http_host="127.0.0.1")
HISTOGRAMS = ("gen_ai_server_time_to_first_token_seconds",
              "phasewatch_inter_token_latency_seconds",
              "gen_ai_server_time_per_output_token_seconds",
              "gen_ai_server_request_duration_seconds",
              "phasewatch_prefill_seconds_per_token")


def _send(ex: Exporter, records) -> None:
    with PhasewatchClient(f"127.0.0.1:{ex.grpc_port}", engine="vllm") as client:
        for r in records:
            client.record_request(r)
        assert client.flush(30)


def test_two_replicas_give_the_quantiles_of_one_exporter(tmp_path):
    now = time.time()
    pods = [scenario(name).build(seed=seed).run(120.0, epoch=now - 130)
            for name, seed in (("chat", 1), ("long_generation", 2))]
    assert all(len(p) > 100 for p in pods)
    with Exporter(ServeConfig(**PORTS)) as a, Exporter(ServeConfig(**PORTS)) as b, \
            Exporter(ServeConfig(**PORTS)) as c:
        _send(a, pods[0])
        _send(b, pods[1])
        _send(c, pods[0] + pods[1])
        total = len(pods[0]) + len(pods[1])
        targets = {f"127.0.0.1:{a.http_port}": {"group": "replicas", "replica": "a"},
                   f"127.0.0.1:{b.http_port}": {"group": "replicas", "replica": "b"},
                   f"127.0.0.1:{c.http_port}": {"group": "single", "replica": "c"}}
        with PrometheusServer(tmp_path, list(targets), target_labels=targets) as prom:
            accepted = "sum by (group) (phasewatch_ingest_accepted_total)"
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                seen = {r["metric"]["group"]: float(r["value"][1])
                        for r in prom.query(accepted)}
                if seen == {"replicas": total, "single": total}:
                    break
                time.sleep(0.5)
            else:
                pytest.fail(f"Prometheus never saw every request: {seen}, want {total}")
            checked = 0
            for name in HISTOGRAMS:
                for q in (0.5, 0.9, 0.99):
                    replicas, single = (prom.scalar(
                        f'histogram_quantile({q}, sum by (le) ({name}_bucket{{group="{g}"}}))')
                        for g in ("replicas", "single"))
                    assert replicas == single, (name, q, replicas, single)
                    checked += 1
                counts = [prom.scalar(f'sum({name}_count{{group="{g}"}})')
                          for g in ("replicas", "single")]
                assert counts[0] == counts[1] > 0, (name, counts)
            for phase in ("queue", "prefill", "decode"):
                replicas, single = (prom.scalar(
                    f"histogram_quantile(0.9, sum by (le) (phasewatch_phase_duration_seconds_"
                    f'bucket{{group="{g}",phase="{phase}"}}))') for g in ("replicas", "single"))
                assert replicas == single, (phase, replicas, single)
            # each replica alone is not the cluster: its own p90 TTFT differs from the
            # whole (the two pods run different workloads)
            alone = prom.scalar('histogram_quantile(0.9, sum by (le) (gen_ai_server_time_to_'
                                'first_token_seconds_bucket{replica="a"}))')
            whole = prom.scalar('histogram_quantile(0.9, sum by (le) (gen_ai_server_time_to_'
                                'first_token_seconds_bucket{group="single"}))')
            assert alone != whole
            assert checked == len(HISTOGRAMS) * 3
