"""Bounded label sets: (model, engine[, pod][, source]) tuples mapped to dense indices,
with caps.

Past ``max_series`` distinct sets, or for a value longer than ``max_value_len``,
the model becomes ``__overflow__`` and the replacement is counted, so a flood of
distinct names cannot grow memory or Prometheus cardinality without bound.

A central (gateway) exporter adds ``pod`` (``--pod-label``): the pod each span's
resource names. Pods have their own cap, ``max_pods``; past it the pod becomes
``__overflow__``, counted. A sidecar leaves pod out: Prometheus adds the target's.

With ``--source-label``, ``source`` says who saw the requests (``record.SOURCES``): the
engine alone, the stream tap alone, or both (joined): a tap's client-visible TTFT is
then never mixed with an engine's own in one series.

``model_names`` (``deployments.ModelNames``) gives every name of a configured model its
one label value before anything else: one model, one label set, whichever receiver the
request came through and whichever of its names it carried.
"""

from __future__ import annotations

import threading

import numpy as np

from phasewatch.requests.record import SOURCES, RequestBatch
from phasewatch.selfstats import SelfStats

OVERFLOW = "__overflow__"
UNKNOWN = "unknown"


class LabelSets:
    def __init__(self, stats: SelfStats, max_series: int = 256, max_value_len: int = 200,
                 pod_label: bool = False, max_pods: int = 64, source_label: bool = False,
                 model_names=None):
        if max_series < 2:
            raise ValueError(f"max_series must be at least 2, got {max_series}")
        self._stats = stats
        self._max = max_series
        self._max_len = max_value_len
        self._max_pods = max_pods
        self._model_names = model_names  # name -> its label value; None: as it is
        self.names: tuple[str, ...] = ("model", "engine", *(("pod",) if pod_label else ()),
                                       *(("source",) if source_label else ()))
        self._with_pod, self._with_source = pod_label, source_label
        self._lock = threading.Lock()
        self._index: dict[tuple, int] = {}
        self._pairs: list[tuple] = []
        self._pods: set[str] = set()

    def __len__(self) -> int:
        return len(self._pairs)

    def pairs(self) -> list[tuple]:
        """Every label set, as tuples of ``names``' values."""
        with self._lock:
            return list(self._pairs)

    def _value(self, label: str, value: str, rows: int) -> str:
        value = value or UNKNOWN
        if len(value) > self._max_len:
            self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label=label,
                            reason="too_long")
            return OVERFLOW
        return value

    def _pod(self, pod: str, rows: int) -> str:
        pod = self._value("pod", pod, rows)
        with self._lock:
            if pod in self._pods or pod == OVERFLOW:
                return pod
            if len(self._pods) < self._max_pods:
                self._pods.add(pod)
                return pod
        self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label="pod",
                        reason="too_many_pods")
        return OVERFLOW

    def _lookup(self, model: str, engine: str, pod: str | None, rows: int,
                source: int = 0) -> int:
        if self._model_names is not None:
            model, known = self._model_names.match(model)
            if not known:
                self._stats.inc("phasewatch_model_unmatched_requests_total", rows)
        model = self._value("model", model, rows)
        engine = self._value("engine", engine, rows)
        key = (model, engine, *(() if pod is None else (self._pod(pod, rows),)),
               *((SOURCES[source],) if self._with_source else ()))
        overflowed = False
        with self._lock:
            idx = self._index.get(key)
            if idx is None and len(self._pairs) >= self._max - 1:
                # One slot stays reserved for the overflow set itself.
                overflowed = True
                key = (OVERFLOW,) * len(key)
                idx = self._index.get(key)
            if idx is None:
                idx = len(self._pairs)
                self._pairs.append(key)
                self._index[key] = idx
        if overflowed:
            self._stats.inc("phasewatch_ingest_label_overflow_total", rows, label="model",
                            reason="too_many_series")
        return idx

    def index(self, model: str, engine: str, pod: str = "", source: int = 0) -> int:
        """The label-set index of one (model, engine[, pod][, source]), with the same
        caps."""
        return self._lookup(model, engine, pod if self._with_pod else None, 1, source)

    def rows(self, batch: RequestBatch) -> np.ndarray:
        """Label-set index of every row; a Python step per distinct set, not per row.

        The batch's ``pod`` column is read only when the pod label is on.
        """
        n_str = len(batch.strings)
        code = batch.model.astype(np.int64) * n_str + batch.engine
        pod_values = ()
        if self._with_pod:  # by name: two refs may hold one pod
            refs, per_row = np.unique(batch.pod, return_inverse=True)
            pod_values, pod_code = np.unique(np.asarray(
                [batch.strings[r] for r in refs.tolist()], dtype=object), return_inverse=True)
            code = code * len(pod_values) + pod_code.reshape(-1)[per_row.reshape(-1)]
        k = len(pod_values) if self._with_pod else 1
        s = len(SOURCES) if self._with_source else 1
        if self._with_source:
            code = code * s + batch.source
        uniq, inverse, counts = np.unique(code, return_inverse=True, return_counts=True)
        lut = np.fromiter(
            (self._lookup(batch.strings[c // s // k // n_str], batch.strings[c // s // k % n_str],
                          str(pod_values[c // s % k]) if self._with_pod else None, int(n),
                          c % s)
             for c, n in zip(uniq.tolist(), counts.tolist(), strict=True)),
            dtype=np.int64, count=len(uniq))
        return lut[inverse.reshape(-1)]
