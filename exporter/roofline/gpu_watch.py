"""The GPU counters ``phasewatch serve`` reads, and which GPUs are which model's.

``GpuWatch`` holds the sources (a dcgm-exporter's page, ``--gpu-metrics-url``; NVML GPM,
``--gpu-nvml``), polls them on the exporter's timer and answers, for one model, the
mean counters of that model's GPUs over the estimate's range. Which GPUs are a model's
is a ``GpuSelector``: ``--gpu-select`` (or a ``[[models]]`` table's ``gpu_select``) in
the form ``pod=NAME``, ``uuid=GPU-..|GPU-..``, ``gpu=0|1`` or several of them joined by
``,`` (all must hold); empty takes every GPU the source sees, which is right beside one
engine and wrong beside several: with more than one model and no selector, no model is
given counters (they could be any model's), and ``unattributed`` says so.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from phasewatch.roofline.gpu_counters import GpuSample, GpuWindow

log = logging.getLogger("phasewatch")

KEYS = {"pod": "pod", "uuid": "uuid", "gpu": "index", "index": "index"}


class GpuSelectorError(ValueError):
    pass


@dataclass(frozen=True)
class GpuSelector:
    """The GPUs that are one engine's: each criterion given must hold (None: any)."""

    pod: tuple[str, ...] | None = None
    uuid: tuple[str, ...] | None = None
    index: tuple[str, ...] | None = None

    @classmethod
    def parse(cls, text: str) -> GpuSelector:
        """``pod=vllm-0``, ``uuid=GPU-a|GPU-b``, ``gpu=0|1``, joined by ``,``; "" any GPU.
        Raises GpuSelectorError with the fix for anything else."""
        found: dict[str, tuple[str, ...]] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, values = part.partition("=")
            key = key.strip().lower()
            names = tuple(v.strip() for v in values.split("|") if v.strip())
            if not sep or key not in KEYS or not names:
                raise GpuSelectorError(
                    f"gpu_select: {part!r} is not pod=NAME, uuid=UUID[|UUID...] or "
                    "gpu=INDEX[|INDEX...] (several joined by ',')")
            field = KEYS[key]
            if field in found:
                raise GpuSelectorError(f"gpu_select: {key} given twice in {text!r}")
            found[field] = names
        return cls(**found)

    @property
    def any(self) -> bool:
        return self.pod is None and self.uuid is None and self.index is None

    def __str__(self) -> str:
        parts = [f"{key}={'|'.join(values)}" for key, values in
                 (("pod", self.pod), ("uuid", self.uuid), ("gpu", self.index))
                 if values is not None]
        return ",".join(parts) or "every GPU"


class CounterSource(Protocol):
    """What ``GpuWatch`` needs of a reader (``DcgmExporterSource``, ``NvmlGpmSource``)."""

    name: str  # "dcgm" or "nvml": the ``gpu_source`` label
    results: Counter  # readings by result ("ok" or the reason none came)

    def poll(self) -> GpuSample | None: ...

    def window(self, start: float, end: float, uuid=None, pod=None,
               index=None) -> GpuWindow | None: ...


@dataclass(frozen=True)
class Attribution:
    """How one model's GPUs were found: the selector, and why none were where so."""

    selector: GpuSelector
    reason: str = ""  # "" when the model's GPUs are read


class GpuWatch:
    """The counter sources and each model's GPUs (``selectors``: model -> selector; a
    model not in it takes ``default``)."""

    def __init__(self, sources: list[CounterSource], selectors: dict[str, GpuSelector],
                 default: GpuSelector = GpuSelector(), models: int = 1):
        self.sources = list(sources)
        self._selectors = dict(selectors)
        self._default = default
        self._models = models

    def __str__(self) -> str:
        return "the GPU counters (" + ", ".join(
            getattr(s, "url", s.name) for s in self.sources) + ")"

    def poll(self) -> None:
        """Read every source once (each counts its own failures; none raises)."""
        for source in self.sources:
            source.poll()

    def close(self) -> None:
        """Release what a source holds (NVML's handle)."""
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def reads(self) -> list[tuple[str, str, int]]:
        """Every source's readings so far: (source name, result, count)."""
        return [(s.name, result, n) for s in self.sources for result, n in
                sorted(s.results.items())]

    def status(self) -> list[dict]:
        """Each source for /api/v1/status: its name, where it reads, its readings by
        result and why the last one gave nothing ("" after a good one)."""
        return [{"source": s.name, "url": getattr(s, "url", ""),
                 "reads": dict(sorted(s.results.items())),
                 "last_error": getattr(s, "last_error", "") or getattr(s, "reason", "")}
                for s in self.sources]

    def attribution(self, model: str) -> Attribution:
        selector = self._selectors.get(model, self._default)
        if selector.any and self._models > 1:
            return Attribution(selector, f"{self._models} models are configured and no "
                               "--gpu-select (or gpu_select in [[models]]) says which GPUs "
                               "are whose")
        return Attribution(selector)

    def window(self, model: str, start: float, end: float) -> GpuWindow | None:
        """The mean counters of ``model``'s GPUs over ``[start, end]``, from the first
        source that has any; None without a sample there or an attribution."""
        found = self.attribution(model)
        if found.reason:
            return None
        s = found.selector
        for source in self.sources:
            got = source.window(start, end, uuid=s.uuid, pod=s.pod, index=s.index)
            if got is not None:
                return got
        return None
