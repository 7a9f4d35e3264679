"""``TapConfig``: every setting of one tap, whether ``phasewatch tap`` runs it (its
flags, ``read(args)``) or ``phasewatch serve --tap-upstream`` does (``ServeConfig.tap``,
read from serve's ``tap_*`` settings). One frozen record, handed to ``server.start``,
``server.tap_of`` and ``workers.serve_forever``, and pickled to each worker process."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from phasewatch.options import TAP_OPTIONS, option_fields
from phasewatch.transport.tls import ClientTls


@dataclass(frozen=True)
@option_fields(TAP_OPTIONS)
class TapConfig:
    """Its fields, first, are ``options.TAP_OPTIONS``, each ``NAME: type = default`` as
    the table has it (``upstream``, ``upstream_ca``, ``ask_usage``, ``host``, ``port``,
    ..., ``workers``; ``options.TAP_ONLY`` are `phasewatch tap`'s alone); then the client
    side of ``phasewatch tap``'s records, to the exporter or the OTLP endpoint."""

    token: str = ""
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
        flags: no prefix; serve's settings by name: ``tap_``), ``also`` on top, the rest
        their defaults."""
        names = [f.name for f in fields(cls) if f.name not in also]
        found = {n: getattr(source, prefix + n) for n in names if hasattr(source, prefix + n)}
        return cls(**found, **also)
