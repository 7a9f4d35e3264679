"""A real Prometheus scrapes the exporter while the simulator runs in real time."""

import threading
import time

import numpy as np

from phasewatch.client import PhasewatchClient
from phasewatch.requests import buckets
from phasewatch.sim.scenarios import scenario
from tests.support.prom import PrometheusServer


def test_prometheus_sees_the_simulators_ttft_and_token_rate(exporter, tmp_path):
    with PrometheusServer(tmp_path, [f"127.0.0.1:{exporter.http_port}"]) as prom:
        engine = scenario("chat").build(seed=11, rate_scale=3.0)
        client = PhasewatchClient(f"127.0.0.1:{exporter.grpc_port}", engine="sim")
        done = threading.Event()
        runner = threading.Thread(target=lambda: (engine.run(
            24.0, on_finish=client.record_request, time_scale=1.0), done.set()))
        runner.start()
        runner.join(60)
        assert done.is_set(), "the simulator did not finish in time"
        client.close()
        time.sleep(2.5)  # let the last flush land and be scraped twice

        records = engine.finished
        assert client.stats["accepted"] == len(records) > 300

        # 1. histogram_quantile over Prometheus's data lands in the bucket holding the
        #    simulator's true median TTFT.
        true_median = float(np.median([r.first_token - r.arrival for r in records]))
        got = prom.scalar("histogram_quantile(0.5, sum by (le) "
                          "(gen_ai_server_time_to_first_token_seconds_bucket))")
        edges = np.array(buckets.TTFT.bounds)
        i = int(np.searchsorted(edges, true_median, side="left"))
        lo = edges[i - 1] if i else 0.0
        assert lo <= got <= edges[i], (got, true_median, lo, edges[i])

        # 2. rate() of the output-token counter matches the simulated output tokens/s
        #    over the same 15 s of wall time (the flush interval and the 1 s scrape
        #    delay what Prometheus sees by about a second).
        at = time.time() - 3.0
        window = 15.0
        lag = 1.0
        finished = [r for r in records if at - lag - window < r.finish <= at - lag]
        simulated = sum(r.output_tokens for r in finished) / window
        rate = prom.scalar('sum(rate(phasewatch_tokens_total{kind="output"}[15s]))', at=at)
        assert abs(rate - simulated) <= 0.10 * simulated, (rate, simulated)
