"""Binding a listener: a bind failure as one line that names the listener, its address
and the flag that moves it (``listening``), for every command's ports alike, and the
demo's way round a taken default port (``or_free_port``, ``moving_taken_ports``)."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

T = TypeVar("T")


class ListenError(OSError):
    """A listener could not bind its address; the message names the listener, the
    address and the flag that moves it. ``flag``: that flag; ``code``: the OS's errno of
    the failed bind (None where the listener gave none)."""

    def __init__(self, message: str, flag: str = "", code: int | None = None):
        super().__init__(message)
        self.flag, self.code = flag, code

    @property
    def taken(self) -> bool:
        """The port is in use by another socket (not a bad address or a privileged port)."""
        return self.code == errno.EADDRINUSE


def address(host: str, port: int) -> str:
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{host}:{port}"


def _errno(error: BaseException) -> int | None:
    for e in (error, error.__cause__, error.__context__):
        if isinstance(e, OSError) and e.errno:
            return e.errno
    return None


def why_not(error: BaseException) -> str:
    """Why a bind failed, in the OS's words ("address already in use"); else the
    error's first clause."""
    code = _errno(error)
    if code is not None:
        return os.strerror(code)[0].lower() + os.strerror(code)[1:]
    return str(error).split(";")[0]


def listening(what: str, flag: str, host: str, port: int, start: Callable[[], T]) -> T:
    """``start()``, with a bind failure (OSError, or gRPC's RuntimeError) turned into a
    ListenError that says which listener, which address and which flag to change. A
    ListenError from ``start`` (a listener that named its own flag) passes as it is."""
    try:
        return start()
    except ListenError:
        raise
    except (OSError, RuntimeError) as e:
        raise ListenError(f"cannot listen on {address(host, port)} for {what} ({flag}): "
                          f"{why_not(e)}", flag, _errno(e)) from e


def or_free_port(what: str, flag: str, host: str, port: int, start: Callable[[int], T],
                 movable: bool) -> tuple[T, int | None]:
    """``start(port)`` under ``listening``; where ``port`` is taken and ``movable`` (a
    default the user did not choose), ``start(0)``, a free one, instead. Returns what
    ``start`` returned and the port that was taken (None if none was)."""
    try:
        return listening(what, flag, host, port, lambda: start(port)), None
    except ListenError as e:
        if not (movable and port and e.taken):
            raise
    return listening(what, flag, host, 0, lambda: start(0)), port


def moving_taken_ports(start: Callable[[Any], T], config: Any, movable: dict[str, str]
                       ) -> tuple[T, Any, dict[str, int]]:
    """``start(config)``; while it fails on a taken port whose option is in ``movable``
    (option name -> its flag: defaults the user did not choose), again with that option
    0 (a free port), once per option. Returns what ``start`` returned, the config it
    started with and the ports that were taken, by option name."""
    taken: dict[str, int] = {}
    while True:
        try:
            return start(config), config, taken
        except ListenError as e:
            name = next((n for n, f in movable.items() if f == e.flag), None)
            if not e.taken or name is None or name in taken or not getattr(config, name):
                raise
            taken[name] = getattr(config, name)
            config = replace(config, **{name: 0})
