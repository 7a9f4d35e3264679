"""Client of the exporter's JSON API (``/api/v1/...``), the dashboard's embedded data source.

Failures come back as ``ExporterUnreachable`` naming the URL tried, so a page can
show "exporter unreachable at URL" rather than a stack trace.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class ExporterUnreachable(ConnectionError):
    def __init__(self, url: str, reason: str):
        super().__init__(f"exporter unreachable at {url}: {reason}")
        self.url = url
        self.reason = reason


class ExporterApi:
    def __init__(self, base_url: str, timeout: float = 3.0):
        parsed = urllib.parse.urlparse(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"exporter URL must look like http://host:9464, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout

    def _get(self, path: str, **params) -> dict:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as e:
            raise ExporterUnreachable(url, f"HTTP {e.code}: {e.read()[:200]!r}") from None
        except (OSError, ValueError) as e:
            raise ExporterUnreachable(url, str(e)) from None

    def summary(self, window: float | None = None) -> dict:
        """Rolling-window summary per (model, engine)."""
        return self._get("/api/v1/summary", window=window)

    def recent_requests(self, limit: int = 200, model: str | None = None) -> list[dict]:
        """Newest requests with their queue/prefill/decode phases, newest first."""
        return self._get("/api/v1/requests", limit=limit, model=model)["requests"]
