"""Flags from the option tables (``options``, ``options_commands``), with their variables
read when the command line is parsed, not when the parser is built (``EnvParser``): every
command's but serve's (``config.add_serve_flags``) through ``add_options``, in its
sections; ``phasewatch tap``'s in ``TAP_GROUPS`` (``add_tap_flags``; ``serve --tap-*``
are the same options through ``config.add_serve_flags``)."""

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
    set (``env`` "": no variable); a bool option is a switch; a required one must have a
    value from its flag or its variable. Its former spelling (``o.old``), hidden, still
    works, with a warning (``DeprecatedAlias``)."""
    kind = dict(action="store_true") if o.type is bool else dict(type=typed(o),
                                                                  metavar=o.value_name)
    action = group.add_argument(flag or o.flag, dest=o.name, default=o.default,
                                help=describe(o, env), **kind)
    if o.old:
        group.add_argument(o.old, dest=o.name, metavar=o.value_name, action=DeprecatedAlias,
                           default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    if o.required and not o.one_of:
        if env:
            action.needed = True  # flag or variable (EnvParser checks)
        else:
            action.required = True
    if not env:
        return action
    if o.type is bool:
        action.type = typed(o)  # converts the variable's text (a switch takes none)
    return from_env(action, env)


def add_options(parser, options: tuple[Option, ...], prefix: str = "",
                groups: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each of ``options`` on ``parser`` (a parser, or an argument group when none has a
    ``group``), in the table's order, its variable its own ``env`` or ``prefix`` + NAME
    (no prefix: none). An option with a ``group`` is listed in that section of --help
    (made on its first option, or found in ``groups``), options with the same ``one_of``
    exclude each other (required: one of them must be given). Returns the sections by
    title."""
    groups = {} if groups is None else groups
    exclusive: dict[str, Any] = {}
    for o in options:
        into = parser
        if o.group:
            if o.group not in groups:
                groups[o.group] = parser.add_argument_group(o.group)
            into = groups[o.group]
        if o.one_of:
            if o.one_of not in exclusive:
                exclusive[o.one_of] = into.add_mutually_exclusive_group(required=any(
                    p.required for p in options if p.one_of == o.one_of))
            into = exclusive[o.one_of]
        add_option(into, o, o.env or (prefix + o.name.upper() if prefix else ""))
    return groups


def add_tap_flags(parser: argparse.ArgumentParser) -> dict[str, Any]:
    """``phasewatch tap``'s flags, in ``TAP_GROUPS``; each reads ``PHASEWATCH_TAP_NAME``.
    The groups by title, for the flags that are not the tap's own."""
    groups = {}
    for title, description, names in TAP_GROUPS:
        groups[title] = group = parser.add_argument_group(title, description or None)
        add_options(group, tuple(_TAP[name] for name in names), TAP_ENV)
    return groups


class DeprecatedAlias(argparse.Action):
    """An old spelling: stores into the new flag's dest and notes itself, so ``main``
    prints one deprecation line for all of them."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        used = getattr(namespace, "deprecated_flags", None) or []
        namespace.deprecated_flags = [*used, option_string]
