"""Which model runs on which hardware: resolved once at start-up, then looked up per label.

A deployment is resolved from configuration (``phasewatch serve --model ...`` or a
``[[models]]`` table in the config file):

* the model from the built-in catalog by name, alias or Hugging Face id, or from a
  Hugging Face ``config.json``; weight and KV-cache dtypes can be overridden
  (``--weight-dtype fp8``, ``--kv-dtype fp8`` as with vLLM's ``--kv-cache-dtype``);
* the hardware from the catalog by name, from a profile written by
  ``phasewatch calibrate``, or detected through NVML (``--hardware auto``, the
  default; needs the optional ``nvidia-ml-py``). When detection is impossible
  (no library, no GPU, an unknown part) the model gets no roofline and a log
  line says why and how to fix it; its latency metrics are unaffected;
* the GPU count (``--gpus``, default: the tensor-parallel degree, else the GPUs
  NVML sees, else 1).

Unknown names and unreadable files raise ``ValueError`` with the fix: bad
configuration fails at start-up.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path

from phasewatch.options import MODEL_OPTIONS, option_fields
from phasewatch.roofline import catalog
from phasewatch.roofline.catalog import HardwareSpec, ModelSpec
from phasewatch.roofline.estimate import Deployment
from phasewatch.roofline.hf_config import load_model_config

log = logging.getLogger("phasewatch")

PROFILE_FORMAT = "phasewatch-hardware-profile/1"


@dataclass(frozen=True)
@option_fields(MODEL_OPTIONS)
class ModelOptions:
    """One ``[[models]]`` entry (or the ``--model`` flags) before resolution. Its fields,
    first, are ``options.MODEL_OPTIONS``, each ``NAME: type = default`` as the table has it
    (``model``, ``hf_config``, ``served_model_name``, ``hardware``, ``hardware_profile``,
    ``gpus`` (0: tensor_parallel, else NVML's count, else 1), ``tensor_parallel``,
    ``weight_dtype``, ``kv_dtype``, ``compute_dtype``, ``max_batched_tokens``,
    ``engine_metrics_url``); then the model's own latency objectives."""

    # latency objectives of this model (a [[models]] table's ``slo``, as --slo takes
    # them); "": the global --slo. Not a roofline input.
    slo: str = ""


def load_profile(path: str | Path, gpus: int) -> HardwareSpec:
    """A hardware profile written by ``phasewatch calibrate``, for ``gpus`` devices."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read hardware profile {path}: {e.strerror}; write one with "
                         "`phasewatch calibrate --output FILE`") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise ValueError(f"{path} is not a phasewatch hardware profile (expected \"format\": "
                         f"\"{PROFILE_FORMAT}\"); write one with `phasewatch calibrate`")
    try:
        measured = data["measured"]
        bw = float(measured["bandwidth_gbps"]) * 1e9
        flops = {d: float(v) * 1e12 for d, v in measured["flops_tflops"].items()}
        per_device = int(data.get("devices", 1))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"hardware profile {path} lacks measured figures ({e})") from None
    if bw <= 0 or per_device < 1 or any(v <= 0 for v in flops.values()):
        raise ValueError(f"hardware profile {path} has non-positive figures")
    try:
        memory = float(data.get("memory_gb") or 0.0) * 1e9 / per_device
    except (TypeError, ValueError):
        raise ValueError(f"hardware profile {path}: memory_gb must be a number") from None
    part = data.get("part")
    if part:  # a known part: datasheet peaks from the catalog, measured ceilings from here
        base = catalog.hardware(part)
        spec = replace(base, measured_bandwidth=bw / per_device,
                       measured_flops={d: v / per_device for d, v in flops.items()})
    else:  # an unknown device (a CPU, say): the measured ceilings are all there is
        spec = HardwareSpec(name=str(data.get("device", "measured")), bandwidth=bw / per_device,
                            flops={d: v / per_device for d, v in flops.items()},
                            measured_bandwidth=bw / per_device,
                            measured_flops={d: v / per_device for d, v in flops.items()},
                            memory_bytes=memory, datasheet=False,
                            cpu=(data.get("method") or {}).get("device") == "cpu")
    return spec.times(gpus)


def detect_nvml() -> tuple[str, int]:
    """(device name, device count) from NVML; raises RuntimeError saying why not."""
    try:
        import pynvml
    except ImportError:
        raise RuntimeError("nvidia-ml-py is not installed (pip install 'phasewatch[nvml]')"
                           ) from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError subclasses: library missing, driver not loaded, ...
        raise RuntimeError(f"NVML could not start: {e}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count < 1:
            raise RuntimeError("NVML sees no GPU")
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return (name.decode() if isinstance(name, bytes) else str(name)), int(count)
    finally:
        pynvml.nvmlShutdown()


def _model(o: ModelOptions) -> tuple[ModelSpec, str]:
    if o.hf_config:
        spec, source = load_model_config(o.hf_config, o.model or None), "hf_config"
    elif o.model:
        spec, source = catalog.model(o.model), "catalog"
    else:
        raise ValueError("a [[models]] entry needs `model` (catalog name or Hugging Face id) "
                         "or `hf_config` (path to config.json)")
    changes = {}
    for key, value in (("weight_dtype", o.weight_dtype), ("kv_dtype", o.kv_dtype)):
        if value:
            catalog.dtype_bytes(value)  # raises, listing the known dtypes
            changes[key] = value.lower()
    return replace(spec, **changes), source


def _hardware(o: ModelOptions, served: str) -> tuple[HardwareSpec | None, str]:
    gpus = o.gpus or o.tensor_parallel
    if o.hardware_profile:
        return load_profile(o.hardware_profile, gpus or 1), "profile"
    if o.hardware and o.hardware.lower() != "auto":
        return catalog.hardware(o.hardware, gpus or 1), "catalog"
    try:
        name, count = detect_nvml()
    except RuntimeError as e:
        log.warning("no roofline for %s: the hardware is missing, not given (--hardware, "
                    "--hardware-profile) and not detected (%s): on a GPU, name it with "
                    "--hardware NAME; %s. Latency and phases are published without it",
                    served, e, catalog.NOT_IN_CATALOG)
        return None, "none"
    try:
        spec = catalog.hardware(name, gpus or count)
    except ValueError as e:
        log.warning("no roofline for %s: NVML found %r, which the catalog lacks (%s); or "
                    "name a catalog part with --hardware NAME. Latency and phases are "
                    "published without it", served, name, e)
        return None, "none"
    log.info("hardware for %s detected through NVML: %s x%d", served, spec.name, spec.gpus)
    return spec, "nvml"


def compute_dtype_for(o: ModelOptions, spec: ModelSpec, hw: HardwareSpec,
                      measured: bool = False) -> str:
    """The dtype whose peak applies: as configured, else fp8 for fp8 weights on parts
    with fp8 tensor cores (W8A8), fp32 for fp32 weights, else 16 bits (weight-only
    schemes such as fp8 on A100, AWQ/GPTQ int4 or MXFP4 compute in 16 bits): fp16 for
    fp16 weights, bf16 otherwise, either where the part has only the other figure
    (the same tensor cores).

    A ceiling holds only for its own dtype: with a measured profile that lacks the
    deployment's dtype the dtype is kept and has no FLOP/s ceiling (a warning says to
    calibrate in it), rather than borrowing another dtype's and publishing a
    "utilization" over 100 %."""
    known = {**hw.measured_flops, **hw.flops}
    if o.compute_dtype:
        compute = o.compute_dtype.lower()
        catalog.dtype_bytes(compute)
        if compute not in known:
            raise ValueError(f"{hw.name} has no {compute} FLOP/s figure; set compute_dtype to "
                             f"one of {', '.join(sorted(known)) or 'none'}, or measure it "
                             "with `phasewatch calibrate` where torch is importable")
        return compute
    if spec.weight_dtype == "fp8" and "fp8" in known:
        return "fp8"
    wanted = {"fp32": ("fp32",), "fp16": ("fp16", "bf16")}.get(spec.weight_dtype,
                                                               ("bf16", "fp16"))
    for compute in wanted:
        if compute in known:
            return compute
    if measured or known:
        log.warning("%s: the hardware profile has no %s FLOP/s ceiling (it has: %s); the "
                    "compute side of the roofline is unknown until one is measured: run "
                    "`phasewatch calibrate` where torch is importable, or set "
                    "--compute-dtype", hw.name, wanted[0], ", ".join(sorted(known)) or "none")
        return wanted[0]
    raise ValueError(f"{hw.name} has no FLOP/s figure in the catalog; measure one with "
                     "`phasewatch calibrate` and pass --hardware-profile")


def served_name(o: ModelOptions, spec: ModelSpec) -> str:
    """The one model label of a configured model: ``--served-model-name`` when set (the
    name clients ask for, and vLLM's own metrics carry), else ``--model``, else the
    name its Hugging Face config gives."""
    return o.served_model_name or o.model or spec.name


def resolve(o: ModelOptions) -> Deployment | None:
    """A deployment, or None when the hardware could not be detected (logged)."""
    spec, model_source = _model(o)
    served = served_name(o, spec)
    hw, hw_source = _hardware(o, served)
    if hw is None:
        return None
    compute = compute_dtype_for(o, spec, hw, measured=hw_source == "profile")
    if o.max_batched_tokens < 1:
        raise ValueError(f"max_batched_tokens must be positive, got {o.max_batched_tokens}")
    return Deployment(served_name=served, model=spec, hardware=hw, compute_dtype=compute,
                      max_batched_tokens=o.max_batched_tokens,
                      tensor_parallel=o.tensor_parallel or hw.gpus, model_source=model_source,
                      hardware_source=hw_source)


class Deployments:
    """Configured deployments, looked up by the model label requests carry.

    A request's model matches a deployment by its served name, or when both
    resolve to the same catalog model (``meta-llama/Llama-3.1-8B-Instruct`` and
    ``Llama-3.1-8B``). Lookups are cached per label.
    """

    def __init__(self, deployments: list[Deployment]):
        self.all = list(deployments)
        self._by_name = {d.served_name: d for d in self.all}
        self._cache: dict[str, Deployment | None] = {}

    def __len__(self) -> int:
        return len(self.all)

    def for_model(self, label: str) -> Deployment | None:
        if label in self._cache:
            return self._cache[label]
        found = self._by_name.get(label)
        if found is None:
            try:
                canonical = catalog.model(label).name
            except ValueError:
                canonical = None
            matches = [d for d in self.all if canonical and d.model.name == canonical]
            found = matches[0] if len(matches) == 1 else None
        if len(self._cache) < 10_000:  # labels are capped upstream; this is a backstop
            self._cache[label] = found
        return found


def _catalog_model(name: str) -> str:
    """The catalog's name for the model ``name`` (or its bare name) denotes, "" for none."""
    for candidate in (name, bare_name(name)):
        try:
            return catalog.model(candidate).name if candidate else ""
        except ValueError:
            continue
    return ""


def bare_name(name: str) -> str:
    """A model name less a revision suffix and a path: ``/models/Llama-3.1-8B@main`` and
    ``org/Llama-3.1-8B`` are ``Llama-3.1-8B`` (transformers serve answers with
    ``<path or id>@<revision>``, vLLM serving a directory with its path)."""
    return name.split("@", 1)[0].rstrip("/\\").rsplit("/", 1)[-1]


class ModelNames:
    """One model, one label: every name that denotes a configured model maps to its
    ``served_name`` (``ModelNames(options)(name)``), whichever source the request came
    from (a tap's record carries the name the server answered with, a vLLM span none, so
    ``--default-model``), so the roofline and verdict find it and tap, engine and joined
    rows share the label.

    Names of a model: its served name, ``--model``, the name its config gives, the
    directory of its ``--hf-config``, and every name the catalog knows it by (aliases
    and Hugging Face ids, case-insensitive, as the catalog resolves them). A name that
    differs from one of those only by a path or a revision suffix (``bare_name``) is the
    same model. With one model configured, every name is that model (a sidecar serves
    one), but a name the catalog knows as another model (``mistralai/Mistral-7B-v0.1``
    beside a configured Llama). A name that denotes two configured models is left as it is (as
    ``Deployments.for_model`` leaves it unmatched), and so is any other name: logged
    once with the configured names (``unmatched``), so that a request that lands under
    "no roofline" says why. Hardware plays no part: a model whose hardware was not
    detected is still one label.
    """

    MAX_LOGGED = 100  # distinct unmatched names logged; the rest are counted only

    def __init__(self, options: list[ModelOptions]):
        exact: dict[str, set[str]] = {}
        folded: dict[str, set[str]] = {}
        self.labels: list[str] = []
        for o in options:
            spec, _ = _model(o)
            label = served_name(o, spec)
            self.labels.append(label)
            names = {label, o.model, spec.name}
            if o.hf_config:
                where = Path(o.hf_config).parent
                names |= {str(where), str(where.resolve())}
            for name in names - {""}:
                exact.setdefault(name, set()).add(label)
            for name in {n for m in (o.model, spec.name) if m for n in catalog.model_names(m)}:
                folded.setdefault(name.lower(), set()).add(label)
            for name in names - {""}:
                folded.setdefault(bare_name(name).lower(), set()).add(label)
        self._exact = {n: ls.pop() for n, ls in exact.items() if len(ls) == 1}
        self._folded = {n: ls.pop() for n, ls in folded.items() if len(ls) == 1}
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    @property
    def single(self) -> str:
        """The label of the one configured model ("" with none or several): the model of
        spans and tap records that name none."""
        return self.labels[0] if len(set(self.labels)) == 1 else ""

    def __call__(self, name: str) -> str:
        return self.match(name)[0]

    def match(self, name: str) -> tuple[str, bool]:
        """(the label ``name`` goes under, whether it denotes a configured model); a
        name matched by no rule while models are configured is logged once."""
        found = self._exact.get(name)
        if found is None:
            found = self._folded.get(name.lower())
        if found is None and name:
            found = self._folded.get(bare_name(name).lower())
        if found is not None:
            return found, True
        if self.single and not _catalog_model(name):
            if name:
                self._tell(name, f"counted as {self.single!r}, the one model configured")
            return self.single, True
        if self.labels:
            self._tell(name, "no roofline or verdict for it: it matches none of the "
                       f"configured models ({', '.join(sorted(set(self.labels)))}); give "
                       "--served-model-name the name the server answers with")
        return name, not self.labels

    def _tell(self, name: str, what: str) -> None:
        with self._lock:
            if name in self._logged or len(self._logged) >= self.MAX_LOGGED:
                return
            self._logged.add(name)
        level = logging.INFO if self.single else logging.WARNING
        log.log(level, "requests for model %r: %s", name, what)
