"""Built-in model and hardware catalogs: data in ``models.json`` / ``hardware.json``.

Each JSON file carries a ``_source`` note; this module only turns the data into
typed specs and resolves names (canonical name, alias or Hugging Face id, case-
insensitive). An unknown name raises ``ValueError`` listing the close matches, so a
typo in a configuration fails at start-up with the fix in the message.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources

# Bytes per stored element. int4/mxfp4 include their block scales:
# int4 with one fp16 scale per 32 weights = 4.5 bits (llama.cpp Q4_0: Llama-2-7B is
# 3.56 GiB); MXFP4 = 4 bits + one 8-bit scale per 32-element block = 4.25 bits (OCP
# Microscaling spec v1.0). "4bit" is the back-of-envelope 4 bits flat, scales
# ignored (the usual "70B at Q4 = 35 GB"; tests/roofline/test_calculator.py).
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 4.5 / 8,
    "mxfp4": 4.25 / 8,
    "4bit": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype.lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a served model, enough for roofline arithmetic."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    params: float  # total parameters
    active_params: float  # parameters used per token (== params for dense models)
    v_head_dim: int | None = None  # MLA: value head width differs from the QK width
    kv_dim_per_layer: int | None = None  # cached elements per token per layer (MLA latent)
    experts: int = 0
    experts_per_token: int = 0
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    note: str = ""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


# Fractions of the datasheet peaks real kernels reach when the part has no measured
# ceiling: a large streaming copy reaches ~90% of HBM bandwidth on H100/H200
# (measured on real parts: 3.0 of 3.35 TB/s, 4.3 of 4.8 TB/s), tuned decode kernels
# ~70-75% (gpt-fast 68.5%, llama.cpp 71.7%); large bf16 GEMMs ~80% of dense peak
# (800 of 989 TFLOP/s), a serving mix less.
DEFAULT_BANDWIDTH_EFFICIENCY = 0.8
DEFAULT_FLOPS_EFFICIENCY = 0.7


@dataclass(frozen=True)
class HardwareSpec:
    """Peak ceilings of one accelerator (or of ``gpus`` of them together)."""

    name: str
    bandwidth: float  # bytes/s, datasheet
    flops: dict[str, float] = field(default_factory=dict)  # dense FLOP/s by dtype
    memory_bytes: float = 0.0
    measured_bandwidth: float | None = None
    measured_flops: dict[str, float] = field(default_factory=dict)
    gpus: int = 1
    # False where ``bandwidth`` and ``flops`` are no vendor's figures but measured ones
    # (a calibrated part the catalog lacks, a CPU): the roofline's lines say "measured"
    datasheet: bool = True
    cpu: bool = False  # measured on a CPU (a calibrate profile): no CUDA graphs, no GPU

    def peak_flops(self, dtype: str = "bf16") -> float:
        """Dense peak for ``dtype``; falls back to the 16-bit figure, then to 0 (unknown)."""
        for key in (dtype, "bf16", "fp16"):
            if key in self.flops:
                return self.flops[key]
        return 0.0

    @property
    def achievable_bandwidth(self) -> float:
        """Measured ceiling if known, else the datasheet x a typical efficiency."""
        return self.measured_bandwidth or self.bandwidth * DEFAULT_BANDWIDTH_EFFICIENCY

    def achievable_flops(self, dtype: str = "bf16") -> float:
        measured = self.measured_flops.get(dtype)
        return measured or self.peak_flops(dtype) * DEFAULT_FLOPS_EFFICIENCY

    def times(self, gpus: int) -> HardwareSpec:
        """The same part, ``gpus`` of them: every ceiling scales linearly."""
        if gpus < 1:
            raise ValueError(f"gpus must be >= 1, got {gpus}")
        k = gpus / self.gpus
        return replace(
            self,
            bandwidth=self.bandwidth * k,
            flops={d: v * k for d, v in self.flops.items()},
            memory_bytes=self.memory_bytes * k,
            measured_bandwidth=None if self.measured_bandwidth is None
            else self.measured_bandwidth * k,
            measured_flops={d: v * k for d, v in self.measured_flops.items()},
            gpus=gpus,
        )


def _load(name: str) -> dict:
    return json.loads(resources.files(__package__).joinpath(name).read_text())


def _index(entries: dict[str, dict]) -> dict[str, str]:
    index: dict[str, str] = {}
    for canonical, entry in entries.items():
        for key in (canonical, *entry.get("aliases", ())):
            index[key.lower()] = canonical
    return index


def _resolve(kind: str, name: str, entries: dict[str, dict], otherwise: str = "") -> str:
    """The canonical name of ``name``; unknown: ValueError with the close matches (or
    all names), then ``otherwise``, the way out for a name outside the catalog."""
    index = _index(entries)
    key = name.strip().lower()
    if key in index:
        return index[key]
    close = difflib.get_close_matches(key, list(index), n=5, cutoff=0.5)
    names = list(dict.fromkeys(index[c] for c in close))  # canonical names, in rank order
    known = ", ".join(names) if names else ", ".join(sorted(entries))
    hint = ("close matches: " if names else "known: ") + known
    raise ValueError(f"unknown {kind} {name!r}; {hint}" + (f"; {otherwise}" if otherwise else ""))


@cache
def _models() -> dict[str, dict]:
    return _load("models.json")["models"]


@cache
def _hardware() -> dict[str, dict]:
    return _load("hardware.json")["parts"]


def model_names(name: str) -> tuple[str, ...]:
    """Every name the catalog knows ``name``'s model by (canonical name, aliases,
    Hugging Face ids), or () when it does not know ``name``; no close-match search."""
    canonical = _index(_models()).get(name.strip().lower())
    if canonical is None:
        return ()
    return (canonical, *_models()[canonical].get("aliases", ()))


def model(name: str) -> ModelSpec:
    canonical = _resolve("model", name, _models(),
                         "or give the model's Hugging Face config.json with --hf-config")
    e = _models()[canonical]
    params = e["params_b"] * 1e9
    return ModelSpec(
        name=canonical,
        layers=e["layers"],
        hidden=e["hidden"],
        heads=e["heads"],
        kv_heads=e["kv_heads"],
        head_dim=e["head_dim"],
        params=params,
        active_params=e.get("active_params_b", e["params_b"]) * 1e9,
        v_head_dim=e.get("v_head_dim"),
        kv_dim_per_layer=e.get("kv_dim_per_layer"),
        experts=e.get("experts", 0),
        experts_per_token=e.get("experts_per_token", 0),
        weight_dtype=e.get("weight_dtype", "bf16"),
        note=e.get("note", ""),
    )


# The way out for hardware the catalog lacks (a CPU has no datasheet figure here), said
# wherever the hardware is missing or unknown.
NOT_IN_CATALOG = ("for a CPU, or a part the catalog lacks, measure it with `phasewatch "
                  "calibrate --output FILE` and pass --hardware-profile FILE")


def hardware(name: str, gpus: int = 1) -> HardwareSpec:
    canonical = _resolve("hardware", name, _hardware(), NOT_IN_CATALOG)
    e = _hardware()[canonical]
    measured = e.get("measured", {})
    spec = HardwareSpec(
        name=canonical,
        bandwidth=e["bandwidth_gbps"] * 1e9,
        flops={d: v * 1e12 for d, v in e["flops_tflops"].items()},
        memory_bytes=e["memory_gb"] * 1e9,
        measured_bandwidth=measured["bandwidth_gbps"] * 1e9 if "bandwidth_gbps" in measured
        else None,
        measured_flops={d: v * 1e12 for d, v in measured.get("flops_tflops", {}).items()},
    )
    return spec.times(gpus) if gpus != 1 else spec
