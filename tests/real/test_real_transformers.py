"""A real ``transformers serve`` (Hugging Face's own OpenAI-compatible server, 5.17.0)
behind ``phasewatch serve --tap-upstream``, nothing in between, as a user puts it beside
any server: ``--hf-config`` of the model it serves, a hardware profile measured here by
``phasewatch calibrate``, and no ``--served-model-name`` (the server answers with
``<model dir>@main``). The model is served in float32, as on most CPUs (its config says
bfloat16; on this one torch's bf16 matmul of 1024 x 1024 measures ~1 GFLOP/s, the small
bf16 matmuls of the server ran 2.65x that, so no bf16 ceiling measured here holds), and
phasewatch is told so (``--weight-dtype fp32 --kv-dtype fp32``).

Streaming clients run for ``SECONDS``; then every request must have been accepted (none
rejected, none dropped), the roofline applied to the model the server named (no
"no roofline" requests), and a verdict given from the client's view with a phase and a
resource, printed. In CI (``CI=true``) a missing ``.venv-transformers`` fails the test;
elsewhere it skips and says what to run.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import IN_CI, Scrape
from tests.engines.capture_transformers import (
    MODEL_DIR,
    TRANSFORMERS_VERSION,
    VENV,
    VENV_PY,
    ensure_model,
    free_port,
    model_name,
    start_transformers,
    stop,
    wait_ready,
)
from tests.support.serve import ServeProcess

SECONDS, STREAMS, MAX_TOKENS = 25.0, 6, 48
RESOURCES = ("compute", "memory_bandwidth", "capacity", "frontend", "overhead")


def require_transformers() -> None:
    if VENV_PY.exists() and (VENV / ".installed").exists() and (VENV / ".phasewatch").exists():
        return
    message = (f"{VENV.name} is missing (transformers {TRANSFORMERS_VERSION}'s `transformers "
               "serve` on the CPU torch); `make engines-venv` installs it (`make test` does)")
    if IN_CI:
        pytest.fail(message)
    pytest.skip(message)


def calibrate(tmp: Path) -> Path:
    """This machine's ceilings, measured with torch in the server's own virtualenv."""
    out = tmp / "cpu-profile.json"
    subprocess.run([str(VENV_PY), "-c",
                    "import sys; from phasewatch.roofline import calibrate as c; "
                    "p = c.calibrate('cpu', 256, 1024, 3); c.write(p, sys.argv[1])", str(out)],
                   check=True, timeout=300, env={"PATH": "/usr/bin:/bin"})
    return out


async def _load(port: int, seconds: float, streams: int) -> dict:
    """``streams`` clients, each streaming one chat completion after another (every
    fifth a /v1/completions), reading each answer whole, for ``seconds``."""
    import aiohttp

    out = {"started": 0, "finished": 0, "failed": [], "statuses": {}}
    deadline = time.time() + seconds

    async def one(session: aiohttp.ClientSession, k: int) -> None:
        n = 0
        while time.time() < deadline:
            n += 1
            serial = f"{k}-{n}"
            if n % 5 == 0:
                path, body = "/v1/completions", {"prompt": f"{serial} Once upon a time"}
            else:
                path, body = "/v1/chat/completions", {"messages": [
                    {"role": "user", "content": f"{serial} tell me about the sea and the sky"}]}
            body |= {"max_tokens": MAX_TOKENS, "stream": True}
            out["started"] += 1
            try:
                async with session.post(f"http://127.0.0.1:{port}{path}", json=body) as r:
                    raw = await r.read()
                    out["statuses"][r.status] = out["statuses"].get(r.status, 0) + 1
                    if r.status == 200 and b'"finish_reason"' in raw:
                        out["finished"] += 1
                    else:
                        out["failed"].append((r.status, raw[:300].decode(errors="replace")))
            except aiohttp.ClientError as e:
                out["failed"].append((0, repr(e)))

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(one(session, k) for k in range(streams)))
    return out


def _get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    require_transformers()
    tmp = tmp_path_factory.mktemp("real-transformers")
    ensure_model(MODEL_DIR)
    profile = calibrate(tmp)
    port = free_port()
    server = start_transformers(tmp, MODEL_DIR, port, extra=("--dtype", "float32"))
    serve = None
    try:
        wait_ready(server, f"http://127.0.0.1:{port}", tmp / "transformers.log")
        serve = ServeProcess(
            tmp, "--tap-upstream", f"http://127.0.0.1:{port}", "--tap-port", "0",
            "--hf-config", str(MODEL_DIR / "config.json"), "--weight-dtype", "fp32",
            "--kv-dtype", "fp32", "--hardware-profile", str(profile),
            "--window-seconds", "30", "--roofline-interval", "1").start()
        tap = int(re.search(r"stream tap on http://[^:]+:(\d+)",
                            serve.log_path.read_text())[1])
        client = asyncio.run(_load(tap, SECONDS, STREAMS))
        time.sleep(3.0)  # the tap hands its records over every 0.25 s; a roofline tick
        pw = f"http://127.0.0.1:{serve.http_port}"
        roofline = json.loads(_get(pw + "/api/v1/roofline"))["models"]
        metrics = Scrape(_get(pw + "/metrics").decode())
    finally:
        if serve is not None:
            serve.stop()
        stop(server)
    return {"client": client, "roofline": roofline, "metrics": metrics,
            "log": serve.log_path.read_text(), "server_log": (tmp / "transformers.log")
            .read_text(errors="replace")[-3000:]}


def test_every_request_through_the_tap_is_accepted(run):
    client, m = run["client"], run["metrics"]
    assert not client["failed"], (client["failed"][:3], run["server_log"])
    assert client["finished"] >= 3 * STREAMS, client
    completed = m.value("phasewatch_tap_requests_total", outcome="completed")
    accepted = m.value("phasewatch_ingest_accepted_total", protocol="tap")
    print(f"\ntransformers serve {TRANSFORMERS_VERSION}: {client['finished']} requests, the "
          f"tap completed {completed}, the exporter accepted {accepted}")
    assert completed == accepted == client["finished"]
    assert not m.total("phasewatch_ingest_rejected_total")
    assert not m.total("phasewatch_tap_token_times_dropped_total")
    assert not m.total("phasewatch_tap_records_dropped_total")
    assert not m.total("phasewatch_model_unmatched_requests_total")
    # the per-token reading held: one ITL gap per emission after the first
    assert m.total("phasewatch_inter_token_latency_seconds_count") > client["finished"] * 10


def test_the_servers_model_name_gets_the_roofline_and_a_verdict(run):
    (entry,) = run["roofline"]
    # the server answered with <model dir>@main; the label is the --hf-config's model
    assert model_name(MODEL_DIR).endswith("@main")
    assert entry["model"] == MODEL_DIR.name and entry["configured"], entry["model"]
    assert not run["metrics"].total("phasewatch_no_roofline_requests_total")
    est, v = entry["estimate"], entry["verdict"]
    assert est["decode"] is not None and est["decode"]["bandwidth_utilization"] is not None
    assert v is not None, est["inputs"]
    print(f"verdict: {v['headline']} ({v['phase']}/{v['resource']}, cause {v['cause']}, "
          f"confidence {v['confidence']})\n  {v['text']}\n  levers: {v['levers']}")
    assert v["view"] == "client" and est["inputs"]["phases"].startswith("client_view")
    assert v["phase"] in ("ttft", "decode") and v["resource"] in RESOURCES, v["text"]
    assert "client's view" in v["text"]
    if v["phase"] == "decode":
        assert v["evidence"]["decode_step_seconds"] > 0 and "A decode step takes" in v["text"]
