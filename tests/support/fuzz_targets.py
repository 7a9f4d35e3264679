"""Every decoder phasewatch runs on outside input, as fuzz targets taking bytes.

Each target feeds its input through the same path the receiver does (decode, then
ingest into a real aggregator) and enforces the contract: the only exception allowed
is the decoder's documented error (answered as a clear error and counted by the
receiver); anything else is a bug. After ingest, no histogram holds a NaN, infinite
or negative observation and no counter went negative, so nothing poisoned can reach
/metrics. Used by ``tests/ingest/test_fuzz.py`` (hypothesis) and ``tests/support/fuzz_atheris.py``
(coverage-guided).
"""

from __future__ import annotations

import math
import os
import tempfile
from argparse import Namespace
from dataclasses import fields

import numpy as np

from phasewatch.aggregation.aggregate import Aggregator
from phasewatch.aggregation.window import RollingWindow
from phasewatch.config import ConfigError, load_serve_config
from phasewatch.ingest import wire
from phasewatch.ingest.adapters import AdapterContext
from phasewatch.ingest.adapters.tgi import parse_duration
from phasewatch.ingest.lifecycle import LifecycleJoiner
from phasewatch.ingest.otlp.ingest import EXTRACT, OtlpIngest
from phasewatch.ingest.otlp.jsonform import json_spans
from phasewatch.ingest.otlp.spans import MalformedPayload, parse_request
from phasewatch.roofline.hf_config import load_model_config
from phasewatch.selfstats import SelfStats


class Pipeline:
    """An aggregator with the OTLP path and the lifecycle joiner in front, no network."""

    def __init__(self):
        self.stats = SelfStats()
        self.aggregator = Aggregator(self.stats, max_series=64,
                                     window=RollingWindow(30.0, 4096))
        self.otlp = OtlpIngest(self.aggregator, AdapterContext(default_model="m"),
                               dedupe_capacity=4096)
        self.joiner = LifecycleJoiner(self.aggregator, max_pending=4096)

    def check(self) -> None:
        """No poisoned observation anywhere: what /metrics would expose is sane."""
        snap = self.aggregator.snapshot()
        for key, (_spec, counts, sums) in snap.histograms.items():
            assert np.all(counts >= 0), f"{key}: negative bucket count"
            assert np.all(np.isfinite(sums)) and np.all(sums >= 0), f"{key}: sum {sums}"
        for key, counts in snap.counters.items():
            assert np.all(counts >= 0), f"{key}: negative counter"
        for (name, labels), v in self.stats.snapshot().items():
            assert math.isfinite(v) and v >= 0, (name, labels, v)


PIPE = Pipeline()


def phasewatch_export(data: bytes) -> None:
    try:
        batch, _ = wire.decode_export(data)
    except wire.MalformedBatch:
        return
    PIPE.aggregator.ingest(batch, "phasewatch")
    PIPE.check()


def phasewatch_lifecycle(data: bytes) -> None:
    try:
        engine, events, _ = wire.decode_lifecycle(data)
    except wire.MalformedBatch:
        return
    PIPE.joiner.add(engine, events)
    PIPE.joiner.sweep()
    PIPE.check()


def _otlp(parse, data: bytes, protocol: str) -> None:
    try:
        msg = parse(data)
    except MalformedPayload:
        return
    PIPE.otlp.export(msg, protocol)
    PIPE.check()


def otlp_protobuf(data: bytes) -> None:
    _otlp(parse_request, data, "otlp_grpc")


def otlp_json(data: bytes) -> None:
    """What the OTLP/HTTP receiver does with a JSON body: the direct reader, falling back
    to protobuf's parser."""
    try:
        spans = json_spans(data, EXTRACT)
    except MalformedPayload:
        return
    PIPE.otlp.export_spans(spans, "otlp_http")
    PIPE.check()


def tgi_duration(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        seconds = parse_duration(text)
    except ValueError:
        return
    assert math.isfinite(seconds) and seconds >= 0, (text, seconds)


def config_file(data: bytes) -> None:
    fd, path = tempfile.mkstemp(suffix=".toml")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        try:
            config = load_serve_config(Namespace(config=path), environ={})
        except ConfigError:
            return
        for f in fields(config):
            v = getattr(config, f.name)
            if isinstance(v, float):
                assert math.isfinite(v), (f.name, v)
    finally:
        os.unlink(path)


def hf_config(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "config.json")
        with open(path, "wb") as f:
            f.write(data)
        try:
            spec = load_model_config(path)
        except ValueError:
            return
    for name in ("layers", "hidden", "heads", "kv_heads", "head_dim"):
        assert getattr(spec, name) > 0, (name, getattr(spec, name))
    for name in ("params", "active_params"):
        v = getattr(spec, name)
        assert math.isfinite(v) and v > 0, (name, v)


TARGETS = {f.__name__: f for f in (phasewatch_export, phasewatch_lifecycle, otlp_protobuf,
                                   otlp_json, tgi_duration, config_file, hf_config)}
