"""Hugging Face ``transformers serve``'s own streamed answers, byte for byte, as fixtures.

Starts the real ``transformers serve`` (transformers 5.17.0, its OpenAI-compatible
server, from ``.venv-transformers``) on a CPU with ``tests/engines/tiny_model.py``'s tiny
offline Llama and writes the raw body of a few requests, exactly as the server sent
them, to ``tests/fixtures/engine/transformers-5.17.0/streams/<name>.sse`` (``.json`` for
the one answer that is not streamed), with a README that says what each holds and
``writes.json``: for each file, how many SSE events each HTTP chunk (one network write
of the server: uvicorn writes each piece the response generator yields as one chunk
of the chunked body) carried.

The server is started three times, because with continuous batching the first request
fixes the sampling configuration (temperature, logit bias) for the server's life:

* continuous batching, greedy: ``chat``, ``chat-include-usage``, ``completions``,
  ``chat-n2``, ``chat-whole``, then four streams at once (``concurrent-1..4``);
* continuous batching, first request biased towards ``</s>``: ``chat-stop`` (the
  random model never picks ``</s>`` greedily; a logit bias of 0.94 on it makes it
  win after six tokens of "Tell me about the sea.");
* without continuous batching: ``chat-no-cb`` and ``chat-stop-no-cb``.

The start/stop helpers (``start_transformers``, ``wait_ready``, ``stop``) use only the
standard library, so a pytest test can import them. Set up once::

    python3 -m venv .venv-transformers
    .venv-transformers/bin/pip install torch==2.13.0
    .venv-transformers/bin/pip install 'transformers[serving]==5.17.0' requests

(``requests``: the ``transformers`` CLI imports it, and the ``serving`` extra does not
install it.) Then, from the repository root::

    python3 -m tests.engines.capture_transformers

Two things to know about ``transformers serve`` on a CPU, both handled here:

* with ``--continuous-batching`` and no ``--cb-*`` sizes, the paged KV cache is sized
  from the machine's total RAM (``psutil``): on a 24 GiB machine the server took
  20 GiB and its first request a minute. ``CB_FLAGS`` pins it to 128 blocks of 32
  tokens (4096 tokens, a few MiB for this model);
* ``GET /v1/models`` lists the Hugging Face cache, not the served model, and answers
  500 when the cache folder does not exist: ``HF_HOME`` points at a fresh folder
  with an empty ``hub/`` so it answers ``{"object":"list","data":[]}``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-transformers"
VENV_PY = VENV / "bin" / "python"
TRANSFORMERS_BIN = VENV / "bin" / "transformers"
TRANSFORMERS_VERSION = "5.17.0"
MODEL_DIR = ROOT / ".cache" / "tiny-llama-tf"
OUT = ROOT / "tests" / "fixtures" / "engine" / f"transformers-{TRANSFORMERS_VERSION}" / "streams"

# A bounded paged cache: without these the CPU cache is sized from the machine's RAM.
CB_FLAGS = ("--cb-block-size", "32", "--cb-num-blocks", "128", "--cb-max-batch-tokens", "512")

# ``</s>`` is token 0 in tiny_model.py's tokenizer; this bias makes greedy decoding of
# STOP_PROMPT pick it after six tokens (the margins were measured with the model).
EOS_ID = 0
EOS_BIAS = 0.94
STOP_PROMPT = "Tell me about the sea."


def model_name(model_dir: Path = MODEL_DIR) -> str:
    """What the server answers in ``model``: the forced path, ``@main`` appended."""
    return f"{model_dir}@main"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_env(tmp: Path) -> dict[str, str]:
    """Offline, no update check, and a Hugging Face home of its own under ``tmp``."""
    hf = tmp / "hf"
    (hf / "hub").mkdir(parents=True, exist_ok=True)  # /v1/models answers 500 without it
    return {
        **os.environ,
        "HF_HOME": str(hf),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    }


def serve_command(model_dir: Path, port: int, *, continuous_batching: bool = True,
                  extra: tuple[str, ...] = ()) -> list[str]:
    command = [str(TRANSFORMERS_BIN), "serve", str(model_dir), "--device", "cpu",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]
    if continuous_batching:
        command += ["--continuous-batching", *CB_FLAGS]
    return command + list(extra)


def start_transformers(tmp: Path, model_dir: Path, port: int, *,
                       continuous_batching: bool = True, extra: tuple[str, ...] = (),
                       log_name: str = "transformers.log") -> subprocess.Popen:
    """``transformers serve`` on ``127.0.0.1:port`` serving ``model_dir`` (loaded before it
    listens), in a session of its own; stdout and stderr to ``tmp / log_name``."""
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    command = serve_command(Path(model_dir), port, continuous_batching=continuous_batching,
                            extra=extra)
    with open(tmp / log_name, "w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=tmp,
                                env=serve_env(tmp), start_new_session=True)
    proc.args = command
    return proc


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout: float = 120.0) -> float:
    """Until ``GET base/health`` answers 200 ``{"status": "ok"}``; the seconds it took.
    The model is loaded before uvicorn listens, so a 200 means it can answer (the
    first request still sets up continuous batching: ~0.1 s with ``CB_FLAGS``).
    Raises with the log's end if the process exits or ``timeout`` passes."""
    start = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"transformers serve exited ({proc.returncode}) while starting:\n"
                               + Path(log).read_text(errors="replace")[-4000:])
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200 and json.loads(r.read()).get("status") == "ok":
                    return time.monotonic() - start
        except (OSError, ValueError):
            pass
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"transformers serve not ready after {timeout:.0f}s:\n"
                               + Path(log).read_text(errors="replace")[-4000:])
        time.sleep(0.2)


def stop(proc: subprocess.Popen | None, timeout: float = 15.0) -> None:
    """SIGTERM to the server's process group (uvicorn shuts down cleanly on it), then
    SIGKILL to whatever of the group is left."""
    if proc is None:
        return
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


def ensure_model(model_dir: Path = MODEL_DIR) -> Path:
    """Build the tiny model with the venv's Python (it is rebuilt only when missing)."""
    subprocess.run([str(VENV_PY), str(ROOT / "tests" / "engines" / "tiny_model.py"),
                    str(model_dir), "--size", "tiny"], check=True, stdout=subprocess.DEVNULL)
    return model_dir


# ---- a client that keeps the wire's chunk boundaries ----

def post_raw(port: int, path: str, body: dict, timeout: float = 120.0
             ) -> tuple[int, dict[str, str], bytes, list[bytes]]:
    """POST ``body`` over a plain HTTP/1.1 socket: status, headers, the body as sent (the
    chunked transfer coding removed, nothing else) and the list of HTTP chunks (one per
    write of the server; ``[body]`` when the answer has a Content-Length)."""
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + data)
        f = s.makefile("rb")
        status = int(f.readline().split()[1])
        headers: dict[str, str] = {}
        while (line := f.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            writes = []
            while True:
                size = int(f.readline().split(b";")[0], 16)
                if size == 0:
                    f.readline()
                    break
                writes.append(f.read(size))
                f.readline()  # CRLF after the chunk
            return status, headers, b"".join(writes), writes
        n = headers.get("content-length")
        raw = f.read(int(n)) if n is not None else f.read()
        return status, headers, raw, [raw]


# ---- what a body holds ----

def events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def shape(obj, prefix: str = "") -> list[str]:
    """Key paths of a chunk, e.g. ``choices[].delta.content``; lists by their first item."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            p = f"{prefix}.{k}" if prefix else k
            out.append(p)
            out += shape(v, p)
    elif isinstance(obj, list) and obj:
        out += shape(obj[0], prefix + "[]")
    return out


def describe(raw: bytes, writes: list[bytes] | None, streamed: bool) -> dict:
    """Event count, distinct chunk shapes, where usage and finish_reason are, [DONE]."""
    if not streamed:
        obj = json.loads(raw)
        return {"events": 0, "shapes": [sorted(shape(obj))], "json": obj}
    evs = events(raw)
    parsed, done, other = [], False, []
    for e in evs:
        if not e.startswith(b"data: "):
            other.append(e.decode(errors="replace"))
            continue
        payload = e[6:]
        if payload.strip() == b"[DONE]":
            done = True
            continue
        parsed.append(json.loads(payload))
    shapes: list[list[str]] = []
    for c in parsed:
        s = sorted(shape(c))
        if s not in shapes:
            shapes.append(s)

    def where(pred):
        return [i for i, c in enumerate(parsed) if pred(c)]

    def text(c):
        ch = (c.get("choices") or [{}])[0]
        return ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")

    return {
        "events": len(evs), "chunks": len(parsed), "done": done, "other": other,
        "shapes": shapes,
        "usage_at": where(lambda c: c.get("usage") is not None),
        "finish_at": where(lambda c: any(ch.get("finish_reason") is not None
                                         for ch in c.get("choices", []))),
        "empty_text_at": where(lambda c: text(c) == ""),
        "choices": sorted({len(c.get("choices", [])) for c in parsed}),
        "indexes": sorted({ch.get("index") for c in parsed for ch in c.get("choices", [])}),
        "last": parsed[-1] if parsed else None,
        "first": parsed[0] if parsed else None,
        "text": "".join(text(c) or "" for c in parsed),
        "events_per_write": [len(events(w)) for w in writes] if writes is not None else None,
        "ends_with_blank_line": raw.endswith(b"\n\n"),
    }


# ---- the requests ----

def chat(content: str, max_tokens: int, **more) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
        "temperature": 0, "seed": 1, "stream": True, **more}


REQUESTS_CB = {
    "chat": chat("Tell me about the sea.", 24),
    "chat-include-usage": chat("Count to ten.", 16, stream_options={"include_usage": True}),
    "completions": ("/v1/completions", {
        "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "seed": 1,
        "stream": True}),
    "chat-n2": chat("Name a colour.", 12, n=2),
    "chat-whole": chat("Tell me about the sea.", 24, stream=False),
}
REQUESTS_STOP = {
    "chat-stop": chat(STOP_PROMPT, 64, logit_bias={str(EOS_ID): EOS_BIAS}),
}
REQUESTS_NO_CB = {
    "chat-no-cb": chat("Tell me about the sea.", 24),
    "chat-stop-no-cb": chat(STOP_PROMPT, 64, logit_bias={str(EOS_ID): EOS_BIAS}),
}
CONCURRENT = [chat(p, 32) for p in ("Tell me about the sea.", "Count to ten.",
                                    "Name a colour.", "What is a token?")]


class Capture:
    def __init__(self, out: Path, model_dir: Path):
        self.out, self.model_dir = out, model_dir
        self.files: dict[str, dict] = {}  # name -> request, description

    def ordered(self) -> list[tuple[str, dict]]:
        """In the order the requests are listed (the concurrent ones by number)."""
        names = [*REQUESTS_CB, *(f"concurrent-{i + 1}" for i in range(len(CONCURRENT))),
                 *REQUESTS_STOP, *REQUESTS_NO_CB]
        rank = {n: i for i, n in enumerate(names)}
        return sorted(self.files.items(), key=lambda kv: rank.get(kv[0].rsplit(".", 1)[0], 99))

    def run(self, port: int, name: str, path: str, body: dict, server: str) -> None:
        body = {"model": str(self.model_dir), **body}
        status, headers, raw, writes = post_raw(port, path, body)
        if status != 200:
            raise SystemExit(f"{name}: transformers serve answered {status}: {raw[:500]!r}")
        streamed = bool(body.get("stream"))
        fname = f"{name}.sse" if streamed else f"{name}.json"
        (self.out / fname).write_bytes(raw)
        d = describe(raw, writes, streamed)
        self.files[fname] = {"path": path, "body": body, "server": server,
                             "content_type": headers.get("content-type"),
                             "headers": {k: v for k, v in headers.items() if k != "date"}, **d}
        print(f"{fname}: {len(raw)} bytes, {d['events']} events, "
              f"writes {d.get('events_per_write')}")


def one_server(tmp: Path, cap: Capture, requests: dict, *, continuous_batching: bool,
               label: str, concurrent: list | None = None) -> dict:
    port = free_port()
    log = tmp / ("transformers-" + "".join(c if c.isalnum() else "-" for c in label) + ".log")
    t0 = time.monotonic()
    proc = start_transformers(tmp, cap.model_dir, port, continuous_batching=continuous_batching,
                              log_name=log.name)
    try:
        base = f"http://127.0.0.1:{port}"
        ready = wait_ready(proc, base, log)
        with urllib.request.urlopen(base + "/v1/models", timeout=10) as r:
            models = r.read().decode()
        for name, (path, body) in requests.items():
            cap.run(port, name, path, body, label)
        if concurrent:
            barrier = threading.Barrier(len(concurrent))
            errors: list[BaseException] = []

            def go(i, path, body):
                try:
                    barrier.wait()
                    cap.run(port, f"concurrent-{i}", path, body, label + ", 4 at once")
                except BaseException as e:  # reported below
                    errors.append(e)

            threads = [threading.Thread(target=go, args=(i + 1, p, b))
                       for i, (p, b) in enumerate(concurrent)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            if errors:
                raise errors[0]
        return {"command": " ".join(proc.args), "ready_s": round(ready, 1),
                "start_to_ready_s": round(time.monotonic() - t0, 1), "models": models}
    finally:
        stop(proc)


def readme(cap: Capture, servers: dict[str, dict]) -> str:
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d")
    cmds = "\n".join(f"- {label} (ready {s['ready_s']} s after start; `/v1/models` answered "
                     f"`{s['models']}`):\n\n      {s['command'].replace(str(ROOT) + '/', '')}\n"
                     for label, s in servers.items())
    rows = []
    for fname, d in cap.ordered():
        body = {k: v for k, v in d["body"].items() if k != "model"}
        if fname.endswith(".json"):
            j = d["json"]
            rows.append(
                f"### `{fname}`\n\n`POST {d['path']}` ({d['server']}), model + "
                f"`{json.dumps(body)}`\n\nOne JSON object (`{d['content_type']}`), keys "
                f"`{', '.join(d['shapes'][0])}`; finish_reason "
                f"`{j['choices'][0].get('finish_reason')}`, "
                f"usage `{json.dumps(j.get('usage'))}`.\n")
            continue
        last = d["last"]
        lastc = last["choices"][0] if last else {}
        tail = (f"delta {json.dumps(lastc.get('delta'))}" if "delta" in lastc
                else f"text {json.dumps(lastc.get('text'))}")
        shapes = "\n".join(f"  - `{', '.join(s)}`" for s in d["shapes"])
        rows.append(
            f"### `{fname}`\n\n`POST {d['path']}` ({d['server']}), model + "
            f"`{json.dumps(body)}`\n\n"
            f"- {d['events']} SSE events (`{d['content_type']}`), "
            f"{'ends with `data: [DONE]`' if d['done'] else 'no `data: [DONE]`'}; "
            f"choices per chunk: {', '.join(map(str, d['choices']))}, "
            f"index(es) {', '.join(map(str, d['indexes']))}\n"
            f"- usage in chunk(s) {d['usage_at']} (0-based), finish_reason in chunk(s) "
            f"{d['finish_at']}: the last chunk is `finish_reason` "
            f"`{lastc.get('finish_reason')}` with usage `{json.dumps(last.get('usage'))}` "
            f"and {tail}\n"
            f"- chunks with empty text: {d['empty_text_at'] or 'none'}\n"
            f"- SSE events per HTTP chunk (network write): {d['events_per_write']}\n"
            f"- text: `{json.dumps(d['text'])}`\n"
            f"- chunk shapes (key paths):\n{shapes}\n")
    headers = json.dumps(cap.files.get("chat.sse", {}).get("headers"))
    shared = [f"`{f}` ({sum(n > 1 for n in d['events_per_write'])} of "
              f"{len(d['events_per_write'])} writes)"
              for f, d in cap.ordered() if d.get("events_per_write")
              and max(d["events_per_write"]) > 1]
    multi = ("writes of 2+ events in " + ", ".join(shared) if shared
             else "every write carried one event")
    title = f"# transformers {TRANSFORMERS_VERSION} (`transformers serve`) answers, as sent"
    return f"""{title}

Captured {today} by `tests/engines/capture_transformers.py` from a real `transformers serve`
(transformers {TRANSFORMERS_VERSION}, torch 2.13.0 CPU, Python 3.11) serving
`tests/engines/tiny_model.py --size tiny` (random weights, built offline), on a 2-core
CPU. Each file is the raw body of one request (HTTP chunked coding removed, nothing
else), not edited. `writes.json` gives, per file, the SSE events in each HTTP chunk:
uvicorn writes each piece the server's response generator yields as one chunk.

Servers (`HF_HOME` a fresh folder, `HF_HUB_OFFLINE=1`; model answered as
`<model dir>@main`):

{cmds}
How `transformers serve` {TRANSFORMERS_VERSION} streams (from these files and its source,
`transformers/cli/serving/chat_completion.py` and `completion.py`):

- chat: the first chunk is `delta: {{"role": "assistant"}}` alone; then one chunk per
  decoded text piece, `delta: {{"content": ...}}`, `finish_reason` absent (the chunks
  are dumped with `exclude_none`: absent, not `null`); the last chunk has `delta: {{}}`,
  `finish_reason` (`length` when max_tokens was reached, `stop` otherwise) and `usage`
  (prompt, completion, total). Every chunk has `system_fingerprint: ""`, `id` = the
  request id (a UUID, also the `x-request-id` header), `model` = `<path>@main`.
- usage is always sent, on the finish chunk only, whatever `stream_options` says
  (`stream_options` and `n` are accepted and ignored with a warning; `n: 2` gives one
  choice).
- no `data: [DONE]` at the end of a chat or completions stream.
- `</s>` (skip_special_tokens) yields no chunk: the stop stream's last text chunk is
  followed by the finish chunk directly, and `usage.completion_tokens` counts the `</s>`
  token (one more than the text chunks).
- completions: no role chunk; chunks `choices[].text` with `finish_reason` and
  `logprobs` absent; the finish chunk has `text: ""`, `finish_reason` and `usage`.
- one event per decoded token, but the handler joins whatever is queued when it wakes
  into one write, so several events can share one network write (HTTP chunk). The role
  chunk and the finish chunk are always written alone. In this capture: {multi}.
- `concurrent-1..4` were sent together (released by one barrier) and ran in one
  continuous batch: they end together, within ~0.4 s.
- `created` is set per chunk (`int(time.time())`), so it can step by a second inside
  one stream. `model` is the absolute path of the capture machine's model folder plus
  `@main`; a request's `model` must be left out or equal the path the server was started
  with exactly (anything else: 400).
- completions chunks carry `object: "text_completion"` and no `system_fingerprint`.
- with continuous batching the first request's sampling settings (temperature,
  `logit_bias`) hold for the server's life; `max_tokens` is per request. Without the
  `--cb-*` sizes the CPU KV cache is sized from the machine's RAM (20 GiB here).

Response headers of `chat.sse` (date left out): `{headers}`

{chr(10).join(rows)}
Regenerate: `python3 -m tests.engines.capture_transformers` (needs `.venv-transformers`,
see the script's docstring).
"""


def main() -> int:
    if not TRANSFORMERS_BIN.exists():
        raise SystemExit(f"{TRANSFORMERS_BIN} missing: see this script's docstring")
    model_dir = ensure_model(MODEL_DIR)
    OUT.mkdir(parents=True, exist_ok=True)
    cap = Capture(OUT, model_dir)
    servers = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        servers["continuous batching"] = one_server(
            tmp, cap, REQUESTS_CB, continuous_batching=True, label="continuous batching",
            concurrent=CONCURRENT)
        biased = "continuous batching, </s> biased"
        servers[biased] = one_server(tmp, cap, REQUESTS_STOP, continuous_batching=True,
                                     label=biased)
        servers["no continuous batching"] = one_server(
            tmp, cap, REQUESTS_NO_CB, continuous_batching=False, label="no continuous batching")
    for name in ("chat-stop.sse", "chat-stop-no-cb.sse"):
        got = cap.files[name]["last"]["choices"][0].get("finish_reason")
        if got != "stop":  # the bias was measured on tiny_model.py's weights: re-measure
            print(f"warning: {name} ended with finish_reason {got!r}, not 'stop'",
                  file=sys.stderr)
    (OUT / "writes.json").write_text(json.dumps(
        {f: d["events_per_write"] for f, d in cap.ordered()
         if d.get("events_per_write") is not None}, indent=1) + "\n")
    (OUT / "README.md").write_text(readme(cap, servers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
