"""Exporter configuration: defaults, a TOML file, ``PHASEWATCH_*`` variables, then flags.

Later sources win. Every key has one definition here (name, type, default, help);
the CLI builds its flags from the same table, so file keys, environment variables
and flags cannot drift apart. Bad values fail at start with the fix in the message.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class Option:
    name: str
    type: type
    default: Any
    help: str
    lo: float | None = None
    hi: float | None = None


SERVE_OPTIONS = (
    Option("grpc_host", str, "127.0.0.1",
           "address for the phasewatch gRPC receiver (a sidecar shares the pod's network)"),
    Option("grpc_port", int, 50051, "phasewatch gRPC port (0 = pick a free one)", 0, 65535),
    Option("http_host", str, "0.0.0.0", "address for /metrics, health and the JSON API"),
    Option("http_port", int, 9464, "HTTP port for /metrics, /healthz, /readyz, /api/v1 "
           "(0 = pick a free one)", 0, 65535),
    Option("window_seconds", float, 30.0, "rolling window of the JSON API summary", 1, 3600),
    Option("window_capacity", int, 65536,
           "most recent requests kept for window quantiles and the waterfall", 1, 10_000_000),
    Option("max_series", int, 256, "cap on distinct (model, engine) label sets; the rest "
           "go to model=\"__overflow__\"", 2, 100_000),
    Option("lifecycle_ttl", float, 600.0,
           "seconds before an unfinished streamed request is evicted (counted)", 1, 86400),
    Option("lifecycle_grace", float, 5.0, "seconds a finished streamed request waits for "
           "missing events before it is completed as is", 0, 3600),
    Option("lifecycle_max_pending", int, 100_000, "cap on requests being joined", 1, 10_000_000),
    Option("grpc_workers", int, 8, "gRPC worker threads", 1, 256),
    Option("log_level", str, "info", "debug, info, warning or error"),
)


@dataclass(frozen=True)
class ServeConfig:
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 50051
    http_host: str = "0.0.0.0"
    http_port: int = 9464
    window_seconds: float = 30.0
    window_capacity: int = 65536
    max_series: int = 256
    lifecycle_ttl: float = 600.0
    lifecycle_grace: float = 5.0
    lifecycle_max_pending: int = 100_000
    grpc_workers: int = 8
    log_level: str = "info"


assert [f.name for f in fields(ServeConfig)] == [o.name for o in SERVE_OPTIONS]
_BY_NAME = {o.name: o for o in SERVE_OPTIONS}


class ConfigError(ValueError):
    pass


def _coerce(option: Option, value: Any, source: str) -> Any:
    try:
        if option.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        v = option.type(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: {option.name} must be {option.type.__name__}, "
                          f"got {value!r}") from None
    if option.type in (int, float) and (
            (option.lo is not None and v < option.lo) or (option.hi is not None and v > option.hi)):
        raise ConfigError(f"{source}: {option.name} must be between {option.lo:g} and "
                          f"{option.hi:g}, got {v!r}")
    if option.name == "log_level" and v.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"{source}: log_level must be debug, info, warning or error, "
                          f"got {value!r}")
    return v


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file with any of the keys below (env: PHASEWATCH_CONFIG)")
    for o in SERVE_OPTIONS:
        flag = "--" + o.name.replace("_", "-")
        parser.add_argument(flag, dest=o.name, default=None, metavar=o.type.__name__.upper(),
                            help=f"{o.help} (default {o.default}; "
                                 f"env PHASEWATCH_{o.name.upper()})")


def load_serve_config(args: argparse.Namespace | None = None,
                      environ: dict[str, str] | None = None) -> ServeConfig:
    """Merge defaults < config file < PHASEWATCH_* environment < command-line flags."""
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {o.name: o.default for o in SERVE_OPTIONS}
    path = getattr(args, "config", None) or environ.get("PHASEWATCH_CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        data = data.get("serve", data)
        unknown = sorted(set(data) - set(_BY_NAME))
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {unknown}; known keys: "
                              f"{', '.join(_BY_NAME)}")
        for k, v in data.items():
            values[k] = _coerce(_BY_NAME[k], v, path)
    for o in SERVE_OPTIONS:
        env = environ.get(f"PHASEWATCH_{o.name.upper()}")
        if env is not None:
            values[o.name] = _coerce(o, env, f"PHASEWATCH_{o.name.upper()}")
        flag = getattr(args, o.name, None) if args is not None else None
        if flag is not None:
            values[o.name] = _coerce(o, flag, "--" + o.name.replace("_", "-"))
    if values["lifecycle_grace"] > values["lifecycle_ttl"]:
        raise ConfigError("lifecycle_grace must not exceed lifecycle_ttl")
    return ServeConfig(**values)
