"""``TapConfig``: every setting of one tap, whether ``phasewatch tap`` runs it (its
flags, ``read(args)``) or ``phasewatch serve --tap-upstream`` does (serve's ``tap_*``
settings, ``read(config, "tap_")``). One frozen record, handed to ``server.start``,
``server.tap_of`` and ``workers.serve_forever``, and pickled to each worker process.
Its fields and defaults are ``options.TAP_OPTIONS``' (checked when imported), plus the
client side of ``phasewatch tap``'s records (``token``, ``client_tls``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from phasewatch.options import TAP_OPTIONS
from phasewatch.transport.tls import ClientTls


@dataclass(frozen=True)
class TapConfig:
    upstream: str = ""  # the server the tap is in front of (an http(s):// base URL)
    upstream_ca: str = ""
    ask_usage: bool = False
    host: str = "127.0.0.1"  # the tap's own listener
    port: int = 8001
    tls_cert_file: str = ""
    tls_key_file: str = ""
    loop: str = "auto"
    engine: str = "tap"  # the records' engine label
    timeout: float = 3600.0  # seconds the upstream may stay silent
    max_body_mib: float = 64.0  # a timed request's body read up to this
    # `phasewatch tap`'s alone (serve's tap: its /metrics, its join, its one process)
    metrics_port: int | None = None
    target: str = "127.0.0.1:50051"
    otlp_endpoint: str = ""
    model: str = ""  # the records' model where a request names none
    workers: int = 1
    token: str = ""  # to the exporter (or the OTLP endpoint)
    client_tls: ClientTls = field(default_factory=ClientTls)

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mib * (1 << 20))

    @property
    def destination(self) -> str:
        """Where the records go, in words."""
        return f"{self.otlp_endpoint} (OTLP spans)" if self.otlp_endpoint else self.target

    @classmethod
    def read(cls, source: object, prefix: str = "", **also) -> TapConfig:
        """The settings ``source`` holds as attributes ``prefix + NAME`` (parsed ``tap``
        flags: no prefix; a ``ServeConfig``: ``tap_``), ``also`` on top, the rest their
        defaults."""
        names = [f.name for f in fields(cls) if f.name not in also]
        found = {n: getattr(source, prefix + n) for n in names if hasattr(source, prefix + n)}
        return cls(**found, **also)


# one definition: the table's defaults are the dataclass's (raise, not assert: -O too)
if [f.name for f in fields(TapConfig)][:-2] != [o.name for o in TAP_OPTIONS] or any(
        getattr(TapConfig(), o.name) != o.default for o in TAP_OPTIONS):
    raise RuntimeError("TapConfig's fields differ from options.TAP_OPTIONS")
