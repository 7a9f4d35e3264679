"""Flags from the option tables (``options``), with their variables read when the
command line is parsed, not when the parser is built (``EnvParser``): ``phasewatch tap``'s
whole parser from ``TAP_OPTIONS`` (``add_tap_flags``; ``serve --tap-*`` are the same
options through ``config.add_serve_flags``), and the clients' ``--token`` and
``--exporter-tls-*`` (``add_client_flags``), which ``tap``, ``simulate`` and ``dashboard``
share."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from phasewatch.options import TAP_ENV, TAP_GROUPS, TAP_OPTIONS, Option, describe

_TAP = {o.name: o for o in TAP_OPTIONS}


class FromEnv(str):
    """A flag's value read from the environment variable ``env``: argparse converts a
    string default with the flag's type, and a bad value must name the variable it came
    from, which the user set, not only the flag they did not use."""

    env = ""

    def __new__(cls, env: str) -> FromEnv:
        value = super().__new__(cls, os.environ[env])
        value.env = env
        return value


class EnvParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose flags marked by ``from_env`` take their variable's
    value, when it is set, as they are parsed, and whose flags marked ``needed`` must have
    a value from one or the other (argparse's ``required`` knows no variables).
    Subparsers are of the same class."""

    def parse_known_args(self, args=None, namespace=None):
        for action in self._actions:
            env = getattr(action, "env", "")
            if env:
                action.default = FromEnv(env) if env in os.environ else action.fallback
        namespace, rest = super().parse_known_args(args, namespace)
        for name, value in vars(namespace).items():  # the marker served its error message
            if isinstance(value, FromEnv):
                setattr(namespace, name, str(value))  # a plain str pickles (tap workers)
        missing = [a.option_strings[0] for a in self._actions
                   if getattr(a, "needed", False) and not getattr(namespace, a.dest, None)]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return namespace, rest


def from_env(action: argparse.Action, env: str) -> argparse.Action:
    """``action``'s default becomes ``$env`` where set, when parsing (``EnvParser``)."""
    action.env, action.fallback = env, action.default
    return action


def typed(o: Option) -> Callable[[str], Any]:
    """``o``'s value from a flag's or a variable's text; ArgumentTypeError says what it
    must be, and names the variable when it came from one."""
    def parse(text: str) -> Any:
        try:
            value = _boolean(text) if o.type is bool else o.type(text)
            ok = (o.lo is None or value >= o.lo) and (o.hi is None or value <= o.hi) \
                and (not o.choices or value in o.choices)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            came = f" (from ${text.env})" if isinstance(text, FromEnv) else ""
            raise argparse.ArgumentTypeError(f"must be {_what(o)}, got {str(text)!r}{came}")
        return value

    parse.__name__ = o.type.__name__
    return parse


def _what(o: Option) -> str:
    if o.choices:
        return "one of " + ", ".join(o.choices)
    if o.type is bool:
        return "true or false"
    kind = "a whole number" if o.type is int else "a number"
    if o.lo is not None and o.hi is None:
        return f"{kind} of at least {o.lo:g}"
    return f"{kind} from {o.lo:g} to {o.hi:g}" if o.lo is not None else kind


def _boolean(text: str) -> bool:
    word = str(text).strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def add_option(group, o: Option, env: str, flag: str = "") -> argparse.Action:
    """``o`` as ``flag`` (default ``--NAME``) on ``group``, its default ``$env`` where
    set; a bool option is a switch."""
    kind = dict(action="store_true") if o.type is bool else dict(
        type=typed(o), metavar=o.metavar or o.type.__name__.upper())
    action = group.add_argument(flag or o.flag, dest=o.name, default=o.default,
                                help=describe(o, env), **kind)
    if o.type is bool:
        action.type = typed(o)  # converts the variable's text (a switch takes none)
    return from_env(action, env)


def add_options(group, options: tuple[Option, ...], prefix: str) -> None:
    """Each of ``options`` on ``group`` (a parser or an argument group), its variable
    its own ``env`` or ``prefix`` + NAME."""
    for o in options:
        add_option(group, o, o.env or prefix + o.name.upper())


def add_tap_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``phasewatch tap``'s flags, in ``TAP_GROUPS``; each reads ``PHASEWATCH_TAP_NAME``.
    The groups by title, for the flags that are not the tap's own."""
    groups = {}
    for title, description, names in TAP_GROUPS:
        groups[title] = group = parser.add_argument_group(title, description or None)
        add_options(group, tuple(_TAP[name] for name in names), TAP_ENV)
    next(a for a in parser._actions if a.dest == "upstream").needed = True  # flag or variable
    return groups


# TLS to the exporter (the client's side) is spelt --exporter-tls-*; --tls-cert-file and
# --tls-key-file are always a listener's own (serve's, the tap's). The old client
# spellings stay as hidden aliases for manifests that use them (issue 26).
DEPRECATED_CLIENT_TLS = {"--tls-ca": "--exporter-tls-ca", "--tls-cert": "--exporter-tls-cert",
                         "--tls-key": "--exporter-tls-key"}


class DeprecatedAlias(argparse.Action):
    """An old spelling: stores into the new flag's dest and notes itself, so ``main``
    prints one deprecation line for all of them."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        used = getattr(namespace, "deprecated_flags", None) or []
        namespace.deprecated_flags = [*used, option_string]


def add_client_flags(p, what: str) -> None:
    """``--token`` and TLS to the exporter (``--exporter-tls-ca/-cert/-key``) on ``p``, a
    parser or an argument group."""
    from_env(p.add_argument("--token", default="", help=f"bearer token {what} (the "
                            "exporter's --auth-token; default $PHASEWATCH_AUTH_TOKEN)"),
             "PHASEWATCH_AUTH_TOKEN")
    for name, what_file, otherwise in (
            ("ca", "CA that signed the exporter's certificate", ", else the system's"),
            ("cert", "client certificate, when the exporter requires one", ""),
            ("key", "key of --exporter-tls-cert", "")):
        env = f"PHASEWATCH_CLIENT_TLS_{name.upper()}"
        from_env(p.add_argument(f"--exporter-tls-{name}", default="", metavar="PEM",
                                help=f"TLS to the exporter: the {what_file} "
                                f"(default ${env}{otherwise})"), env)
        p.add_argument(f"--tls-{name}", dest=f"exporter_tls_{name}", metavar="PEM",
                       action=DeprecatedAlias, default=argparse.SUPPRESS,
                       help=argparse.SUPPRESS)
