"""GET JSON over HTTP with a timeout, turning every failure into a ``SourceError``."""

from __future__ import annotations

import gzip
import json
import urllib.error
import urllib.parse
import urllib.request

from phasewatch.dashboard.frames import SourceError
from phasewatch.transport.auth import bearer
from phasewatch.transport.tls import ClientTls


class FetchError(Exception):
    def __init__(self, error: SourceError):
        super().__init__(error.message)
        self.error = error


def base_url(url: str, example: str) -> str:
    """``url`` without a trailing slash; a ValueError showing ``example`` if it is not
    an http(s) URL (``localhost:9464`` would otherwise fail later and obscurely)."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"the URL must look like {example}, got {url!r}")
    return url.rstrip("/")


def get_json(url: str, timeout: float, what: str, target: str | None = None,
             token: str = "", tls: ClientTls | None = None) -> object:
    """``what`` names the service in messages ("exporter", "Prometheus"); ``target`` is
    what the error names as tried (default the URL); ``token`` a bearer token; ``tls``
    the CA and client certificate for an https URL."""
    headers = {"Accept-Encoding": "gzip", "Accept": "application/json"}
    if token:
        headers["Authorization"] = bearer(token)
    req = urllib.request.Request(url, headers=headers)
    try:
        context = tls.ssl_context() if tls is not None and tls.enabled else None
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            body = _read(resp)
    except urllib.error.HTTPError as e:
        body = _read(e)
        raise FetchError(SourceError("http", f"{what} answered HTTP {e.code}: "
                                     f"{_error_text(body)}", target or url)) from None
    except OSError as e:  # URLError, timeouts and refused connections are all OSErrors
        reason = getattr(e, "reason", e)
        raise FetchError(SourceError("unreachable", f"cannot reach the {what}: {reason}",
                                     target or url)) from None
    try:
        return json.loads(body)
    except ValueError:
        raise FetchError(SourceError("http", f"{what} did not answer JSON "
                                     f"({body[:80]!r})", target or url)) from None


def _read(resp) -> bytes:
    body = resp.read()
    return gzip.decompress(body) if resp.headers.get("Content-Encoding") == "gzip" else body


def _error_text(body: bytes) -> str:
    try:
        obj = json.loads(body)
        if isinstance(obj, dict) and "error" in obj:
            return str(obj["error"])
    except ValueError:
        pass
    return body[:200].decode("utf-8", "replace").strip() or "(empty body)"
