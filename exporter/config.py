"""Exporter configuration: defaults, a TOML file, ``PHASEWATCH_*`` variables, then flags.

Later sources win. Every key has one definition (name, type, default, help), in
``options``; the CLI builds its flags from the same table, so file keys, environment
variables and flags cannot drift apart. Bad values fail at start with the fix in the message.
"""

from __future__ import annotations

import argparse
import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phasewatch.options import (
    MODEL_OPTIONS,
    SERVE_GROUPS,
    SERVE_OPTIONS,
    SERVE_TAP,
    Option,
    describe,
    option_fields,
)
from phasewatch.requests.objectives import ObjectivesByModel, parse_objectives
from phasewatch.roofline.deployments import ModelOptions
from phasewatch.transport.admission import container_memory_limit
from phasewatch.transport.listen import ListenError

if TYPE_CHECKING:
    from phasewatch.tap.config import TapConfig

__all__ = ["SERVE_GROUPS", "SERVE_OPTIONS", "ConfigError", "ListenError", "Option",
           "ServeConfig", "add_serve_flags", "load_serve_config"]


# a [[models]] table's keys: serve's model options (their flags fill model_flags), and
# ``slo``, the model's own --slo
MODEL_KEYS = tuple(o.name for o in MODEL_OPTIONS)
TABLE_KEYS = (*MODEL_KEYS, "slo")
# ServeConfig's own options: every serve option but the model's and the tap's
CONFIG_OPTIONS = tuple(o for o in SERVE_OPTIONS if o not in MODEL_OPTIONS + SERVE_TAP)


def _tap(**settings: Any) -> TapConfig:
    """Serve's tap settings as the tap's record. Imported here, when a ServeConfig is
    made: the tap's package (aiohttp and all) loads for serve and the demo, not for
    every command whose parser names this module."""
    from phasewatch.tap.config import TapConfig

    return TapConfig(**settings)


@dataclass(frozen=True)
@option_fields(CONFIG_OPTIONS)
class ServeConfig:
    """``phasewatch serve``'s settings. Its fields, first, are ``options.SERVE_OPTIONS``
    but the model's and the tap's (``CONFIG_OPTIONS``: ``grpc_host``, ``grpc_port``, ...,
    ``slo``), each ``NAME: type = default`` as the table has it; then the stream tap in
    this process (``tap``, from the ``tap_*`` options: ``options.SERVE_TAP``) and the
    models (``options.MODEL_OPTIONS``: the flags' one and the file's tables)."""

    tap: TapConfig = field(default_factory=_tap)  # --tap-*; no upstream: no tap
    model_flags: ModelOptions = field(default_factory=ModelOptions)  # --model, ... flags
    models: tuple[ModelOptions, ...] = ()  # [[models]] tables of the config file

    def memory_limit_bytes(self) -> int:
        """--memory-limit-mib, or 0.8 x the container's limit when it is 0 (0: none)."""
        if self.memory_limit_mib:
            return int(self.memory_limit_mib * (1 << 20))
        return int(container_memory_limit() * 0.8)

    def service_models(self) -> dict[str, str]:
        """--otlp-model-map parsed: service.name -> model."""
        out = {}
        for pair in filter(None, (p.strip() for p in self.otlp_model_map.split(","))):
            service, sep, model = pair.partition("=")
            if not sep or not service.strip() or not model.strip():
                raise ConfigError(f"otlp_model_map: {pair!r} is not service.name=model")
            out[service.strip()] = model.strip()
        return out

    def model_options(self) -> list[ModelOptions]:
        """Every configured model: the file's [[models]] and the --model flags."""
        flags = self.model_flags
        return [*self.models, *([flags] if flags.model or flags.hf_config else [])]

    def objectives(self, labels: list[str]) -> ObjectivesByModel:
        """--slo, and each model's own ``slo`` by its label (``labels``: the model label
        of each of ``model_options()``, in order)."""
        return ObjectivesByModel(parse_objectives(self.slo), {
            label: parse_objectives(o.slo)
            for o, label in zip(self.model_options(), labels, strict=True) if o.slo})


_BY_NAME = {o.name: o for o in SERVE_OPTIONS}
CLASSIC_BUCKETS = ("full", "coarse")


class ConfigError(ValueError):
    pass


def _coerce(option: Option, value: Any, source: str) -> Any:
    try:
        if option.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        v = _boolean(value) if option.type is bool else option.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {option.name} must be {option.type.__name__}, "
                          f"got {value!r}") from None
    if option.type in (int, float) and (
            not math.isfinite(v) or
            (option.lo is not None and v < option.lo) or (option.hi is not None and v > option.hi)):
        raise ConfigError(f"{source}: {option.name} must be between {option.lo:g} and "
                          f"{option.hi:g}, got {v!r}")
    if option.choices and v not in option.choices:
        raise ConfigError(f"{source}: {option.name} must be one of "
                          f"{', '.join(option.choices)}, got {value!r}")
    if option.name == "log_level" and v.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{source}: log_level must be debug, info, warning or error, "
                          f"got {value!r}")
    return v


def _boolean(value: Any) -> bool:
    text = str(value).strip().lower()  # True and False too ("true", "false")
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError




def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file with any of the keys below (env: PHASEWATCH_CONFIG)")
    for title, description, names in SERVE_GROUPS:
        group = parser.add_argument_group(title, description or None)
        for name in names:
            o = _BY_NAME[name]
            group.add_argument(o.flag, dest=o.name, default=None,
                               metavar=o.metavar or o.type.__name__.upper(),
                               help=describe(o, f"PHASEWATCH_{o.name.upper()}"))


def load_serve_config(args: argparse.Namespace | None = None,
                      environ: dict[str, str] | None = None,
                      given: set[str] | None = None) -> ServeConfig:
    """Merge defaults < config file < PHASEWATCH_* environment < command-line flags.
    ``given``: a set to add the name of every option the file, the environment or a
    flag set (the rest kept their defaults)."""
    given = set() if given is None else given
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {o.name: o.default for o in SERVE_OPTIONS}
    slo_source = "slo"  # where the value checked last came from, for its error
    path = getattr(args, "config", None) or environ.get("PHASEWATCH_CONFIG")
    models: tuple[ModelOptions, ...] = ()
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        top = data
        if not isinstance(top.get("serve", top), dict):
            raise ConfigError(f"config file {path}: `serve` must be a table ([serve])")
        data = dict(top.get("serve", top))
        tables = data.pop("models", None)
        if tables is None and "serve" in top:
            tables = top.get("models")  # [[models]] beside a [serve] table
        models = _model_tables(tables or [], path)
        unknown = sorted(set(data) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {unknown}; known keys: "
                              f"{', '.join(_BY_NAME)}")
        for k, v in data.items():
            values[k] = _coerce(_BY_NAME[k], v, path)
            given.add(k)
        if "slo" in data:
            slo_source = f"config file {path}: slo"
    for o in SERVE_OPTIONS:
        env = environ.get(f"PHASEWATCH_{o.name.upper()}")
        if env is not None:
            values[o.name] = _coerce(o, env, f"PHASEWATCH_{o.name.upper()}")
            given.add(o.name)
            slo_source = "PHASEWATCH_SLO" if o.name == "slo" else slo_source
        flag = getattr(args, o.name, None) if args is not None else None
        if flag is not None:
            values[o.name] = _coerce(o, flag, "--" + o.name.replace("_", "-"))
            given.add(o.name)
            slo_source = "--slo" if o.name == "slo" else slo_source
    if values["classic_buckets"] not in CLASSIC_BUCKETS:
        raise ConfigError(f"classic_buckets must be one of {', '.join(CLASSIC_BUCKETS)}, not "
                          f"{values['classic_buckets']!r}")
    if values["lifecycle_grace"] > values["lifecycle_ttl"]:
        raise ConfigError("lifecycle_grace must not exceed lifecycle_ttl")
    _check_slo(values["slo"], slo_source)
    flags = ModelOptions(**{k: values.pop(k) for k in MODEL_KEYS})
    tap = _tap(**{o.name[4:]: values.pop(o.name) for o in SERVE_TAP})
    return ServeConfig(**values, tap=tap, model_flags=flags, models=models)


def _model_tables(tables: Any, path: str) -> tuple[ModelOptions, ...]:
    """The config file's [[models]] array of tables, each with MODEL_KEYS."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigError(f"config file {path}: `models` must be an array of tables "
                          "([[models]])")
    out = []
    for i, table in enumerate(tables):
        unknown = sorted(set(table) - set(TABLE_KEYS))
        if unknown:
            raise ConfigError(f"config file {path}: [[models]] #{i + 1}: unknown keys "
                              f"{unknown}; known keys: {', '.join(TABLE_KEYS)}")
        where = f"{path} [[models]] #{i + 1}"
        if "slo" in table:
            if not isinstance(table["slo"], str):
                raise ConfigError(f"config file {where}: slo must be a string of KEY:VALUE "
                                  f"pairs (\"ttft:500,tpot:50\"), got {table['slo']!r}")
            _check_slo(table["slo"], f"config file {where}: slo")
        out.append(ModelOptions(**{k: _coerce(_BY_NAME[k], v, where)
                                   for k, v in table.items()}))
    return tuple(out)


def _check_slo(text: str, source: str) -> None:
    """Objectives parsed at start: the first bad pair, named with where it came from."""
    try:
        parse_objectives(text)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None
