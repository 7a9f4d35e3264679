"""A golden /metrics page: one fixed input, the exporter's whole page in the three formats
it serves, compared byte for byte with the committed files (as node_exporter's end-to-end
test compares its output with a fixture).

The input: the simulator's ``chat`` and ``overload`` scenarios (fixed seeds, a fixed
epoch) on two engines, a batch with rows that must be rejected, on an exporter built
with a fixed clock and two models configured (one with a roofline). The roofline is
updated once at a fixed time. What a page carries that no input fixes is left out:
``process_*`` and ``python_*`` (the process's own figures) and the build's version;
computed values are kept to 9 significant digits and compared within ``CLOSE``.

Any change to names, HELP texts, label order, buckets, values or formats shows here as
a diff. When it is meant, regenerate and commit the files::

    PHASEWATCH_UPDATE_FIXTURES=1 .venv/bin/python -m pytest tests/publish/test_golden_metrics.py
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import replace

import pytest
from google.protobuf import text_format

from phasewatch.app import Exporter
from phasewatch.config import ServeConfig
from phasewatch.publish import exposition
from phasewatch.requests.record import RequestBatch, RequestRecord
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.sim.scenarios import SCENARIOS
from tests.support import FIXTURES

GOLDEN = FIXTURES / "golden"
EPOCH = 1_750_000_000.0
RUN = 40.0
ACCEPT = {"text": "text/plain;version=0.0.4",
          "openmetrics": "application/openmetrics-text;version=1.0.0",
          "protobuf": "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
                      "encoding=delimited"}
UNFIXED = re.compile(r"^(process_|python_|phasewatch_build_info"
                     r"|phasewatch_scrape_collector_duration)")


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _exporter() -> Exporter:
    clock = Clock(EPOCH + RUN)  # the records arrive as the run ends
    config = ServeConfig(grpc_port=0, http_port=0, otlp_grpc_port=0, otlp_http_port=0,
                         model_flags=ModelOptions(model="Llama-3.1-8B", hardware="H100-SXM"),
                         models=(ModelOptions(model="Qwen2.5-7B"),))
    ex = Exporter(config, clock=clock)
    for name, engine, seed in (("chat", "vllm", 1), ("overload", "sglang", 2)):
        records = [replace(r, engine=engine) for r in SCENARIOS[name].build(
            seed=seed, model="Llama-3.1-8B").run(RUN, epoch=EPOCH)]
        for i in range(0, len(records), 500):
            ex.trace_join.ingest(RequestBatch.from_records(records[i:i + 500]), "phasewatch")
    t = EPOCH + 5
    bad = [RequestRecord("Qwen2.5-7B", arrival=t, scheduled=t + 0.1, first_token=t - 1,
                         last_token=t + 1, finish=t + 1, prompt_tokens=10, output_tokens=3),
           RequestRecord("Qwen2.5-7B", arrival=t, scheduled=t + 0.1, first_token=t + 0.2,
                         last_token=t + 1, finish=t + 1, prompt_tokens=10, output_tokens=3,
                         finish_reason="length")]
    ex.trace_join.ingest(RequestBatch.from_records(bad, engine="tgi"), "otlp_grpc")
    clock.t = EPOCH + RUN + 1
    ex.monitor.update()
    return ex


NUMBER = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?")
# how far a computed value may move between CPUs: numpy's SIMD paths differ in the last
# bits, and the simulator's times (its exp and log among them) with them, which can move
# a request across a step's boundary: an Intel host read the decode bandwidth 3.6e-5 off
# the AMD one's that wrote the files. Counts (no decimal point) and every name, label
# and format are compared exactly.
CLOSE = 1e-3


def _nine_digits(text: str) -> str:
    """Computed values to 9 significant digits, as the files keep them."""
    def short(m: re.Match) -> str:
        digits = re.sub(r"[eE].*", "", m[0]).replace("-", "").replace(".", "").lstrip("0")
        return f"{float(m[0]):.9g}" if len(digits) > 9 else m[0]
    return NUMBER.sub(short, text)


def _same(got: str, want: str) -> bool:
    """One line of the page against the file's: the same but for computed values within
    ``CLOSE`` of each other."""
    if got == want:
        return True
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    return all(math.isclose(float(a), float(b), rel_tol=CLOSE, abs_tol=1e-12)
               for a, b in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True))


def _fixed(page: str) -> str:
    """The page without the families no input fixes (their HELP, TYPE and samples)."""
    return _nine_digits("".join(line + "\n" for line in page.splitlines()
                                if not UNFIXED.match(re.sub(r"^# (HELP|TYPE|UNIT) ", "",
                                                            line))))


def _protobuf_text(body: bytes) -> str:
    families = exposition.read_delimited(body)
    return _nine_digits("".join(f"--- {f.name}\n{text_format.MessageToString(f)}"
                                for f in families if not UNFIXED.match(f.name)))


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    ex = _exporter()
    out = {}
    for fmt, accept in ACCEPT.items():
        body, _ = ex.metrics_page.render(accept)
        out[fmt] = _protobuf_text(body) if fmt == "protobuf" else _fixed(body.decode())
    return out


@pytest.mark.parametrize("fmt", list(ACCEPT))
def test_the_metrics_page_is_the_golden_one(pages, fmt):
    path = GOLDEN / f"metrics.{fmt}.txt"
    if os.environ.get("PHASEWATCH_UPDATE_FIXTURES"):
        GOLDEN.mkdir(parents=True, exist_ok=True)
        path.write_text(pages[fmt])
    want = path.read_text()
    got_lines, want_lines = pages[fmt].splitlines(), want.splitlines()
    first = next((i for i, (a, b) in enumerate(zip(got_lines, want_lines, strict=False))
                  if not _same(a, b)), None)
    if first is None and len(got_lines) != len(want_lines):
        first = min(len(got_lines), len(want_lines))
    if first is not None:  # name the first line that differs, not a 100 kB diff
        pytest.fail(f"{path.name} line {first + 1} differs:\n"
                    f"  golden: {want_lines[first] if first < len(want_lines) else '<end>'}\n"
                    f"  now:    {got_lines[first] if first < len(got_lines) else '<end>'}\n"
                    "(if meant: PHASEWATCH_UPDATE_FIXTURES=1 pytest "
                    "tests/publish/test_golden_metrics.py)")


def test_a_value_moved_past_close_or_any_other_change_is_a_difference():
    line = 'phasewatch_achieved_bandwidth_bytes_per_second{phase="decode"} 2.22961038e+12'
    assert _same(line, line.replace("2.22961038", "2.22952977"))  # the Intel host's
    assert not _same(line, line.replace("2.22961038", "2.2"))  # 1.3 % off
    assert not _same(line, line.replace("decode", "prefill"))
    assert not _same("phasewatch_requests_total 5", "phasewatch_requests_total 6")


def test_the_golden_page_holds_what_the_input_makes(pages):
    """The fixed input reaches every kind of family: both engines' request histograms,
    the rejected rows, a verdict for the model with a roofline and none for the other."""
    text = pages["text"]
    for needle in ('engine="vllm"', 'engine="sglang"', "phasewatch_bottleneck_info{",
                   'phasewatch_ingest_rejected_total{protocol="otlp_grpc",reason=',
                   'gen_ai_server_time_to_first_token_seconds_bucket{engine="vllm"',
                   'phasewatch_peak_flops_per_second{ceiling="datasheet"'):
        assert needle in text, needle
    assert 'phasewatch_bottleneck_info{cause="' in text
    assert "_native" in pages["protobuf"] and "schema: 4" in pages["protobuf"]
    assert not re.search(r"^process_|^python_", text, re.M)
