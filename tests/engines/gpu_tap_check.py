#!/usr/bin/env python3
"""phasewatch's stream tap in front of a real ``transformers serve`` on one GPU, in one go.

On a machine with one NVIDIA GPU (an H100 80GB here), from the repository root::

    python3 tests/engines/gpu_tap_check.py --out DIR

1. builds an 8B-shaped Llama (Llama-3.1-8B's shape: hidden 4096, 32 layers, 32 heads,
   8 KV heads, intermediate 14336, vocab 128256, rope theta 500000) with random weights,
   offline: created on the meta device, laid out in bf16 on the GPU (``to_empty``) and
   filled in place, saved as safetensors with ``tests/engines/tiny_model.py``'s tokenizer
   widened to the model's 128256 ids (each extra id decodes to a text of its own, so
   every generated token is a streamed chunk);
2. runs ``phasewatch calibrate --device cuda`` (``gpu-profile.json``);
3. for each of ``--modes`` (eager, then graphs: ``--cb-use-cuda-graph``): starts
   ``transformers serve DIR --device cuda --continuous-batching`` (its KV cache sized
   from the GPU's memory unless ``--cb-flags`` says otherwise), waits for ``/health``
   and warms it up with requests sent to it directly (not counted); starts ``phasewatch
   serve --tap-upstream ... --hf-config DIR/config.json --hardware auto --gpu-nvml true
   --window-seconds 30 --roofline-interval 1`` on free ports (the GPU's counters read by
   phasewatch itself); drives 8 streaming chat clients for 20 s through the tap, then 48
   (each request ``max_tokens`` 128, a short prompt, no ``model``); after each phase
   reads ``/api/v1/roofline`` and ``/metrics`` into ``--out``
   (``roofline-MODE-N.json``, ``metrics-MODE-N.txt``) and prints what the clients saw,
   the tap and ingest counters, the roofline entry's figures and verdict, and the
   estimate beside phasewatch's GPU counters; samples NVML (and GPM where the GPU and
   driver allow it) once a second itself meanwhile, as a second opinion; stops both;
4. prints calibrate against the datasheet and a recap, and exits 1 where
   ``gpu_findings.failures`` finds a reason: the estimate above the GPU's counted
   traffic or work, a utilization above 1, calibrate above the datasheet, or no GPU
   counters read at all (``summary.json``'s ``failures``);
5. stops every process it started (process groups, in ``finally``), within a global
   time limit (``--time-limit``, 480 s for the 8B), removes the model, and writes
   ``summary.json`` and the logs' ends to ``--out``.

On a CPU (to test this script)::

    .venv/bin/python tests/engines/gpu_tap_check.py --size tiny --out /tmp/tap-check \\
        --tf-python .venv-transformers/bin/python --pw-python .venv/bin/python --seconds 10

``--size tiny`` serves ``tests/engines/tiny_model.py``'s tiny model in float32 on the CPU
with bounded ``--cb-*`` sizes, and gives phasewatch a profile measured by ``phasewatch
calibrate`` and fp32 dtypes, as ``tests/real/test_real_transformers.py`` does. ``--size mini``
is the 8B's build path (meta device, widened tokenizer, 128256 ids) at a small shape, on
the CPU the same way.

``--tf-python`` runs the model build and ``transformers serve`` (needs torch,
transformers and its serving extras), ``--pw-python`` runs ``phasewatch serve``; the
clients and the NVML sampler run in the Python that runs this script (aiohttp; NVML
through nvidia-ml-py, optional).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.engines.capture_transformers import stop as stop_group  # noqa: E402
from tests.engines.gpu_findings import (  # noqa: E402
    calibrate_line,
    calibrate_vs_datasheet,
    failures,
    gpu_block,
    gpu_line,
)
from tests.engines.serve_ports import FREE, PATTERNS, TAP_PATTERN  # noqa: E402

TINY_MODEL = ROOT / "tests" / "engines" / "tiny_model.py"

# hidden, intermediate, layers, attention heads, KV heads, head dim, vocab, max positions
SHAPES = {
    "8b": (4096, 14336, 32, 32, 8, 128, 128256, 8192),
    # the 8B's build path at a small shape, for a CPU
    "mini": (256, 512, 2, 4, 2, 64, 128256, 8192),
}
ROPE_THETA = 500000.0
MODEL_DIRS = {"8b": "llama-3.1-8b-shape-random", "mini": "llama-mini-random",
              "tiny": "tiny-llama-tf"}
# tests/engines/capture_transformers.py's bounded paged cache, for a CPU
CPU_CB_FLAGS = "--cb-block-size 32 --cb-num-blocks 128 --cb-max-batch-tokens 512"
PROMPT = "tell me about the sea and the sky"
# phasewatch serve's free ports and the log lines that say which it bound, with the tap's
PW_PATTERNS = {**PATTERNS, "tap_port": TAP_PATTERN}
PW_FREE = FREE
VERSIONS = ("torch", "transformers", "tokenizers", "huggingface-hub", "accelerate", "fastapi",
            "starlette", "uvicorn", "pydantic", "pydantic-core", "openai", "typing-extensions",
            "anyio", "phasewatch", "protobuf", "grpcio", "opentelemetry-sdk", "aiohttp",
            "uvloop", "numpy", "prometheus-client", "nvidia-ml-py")
LOG_TAIL = 400_000  # bytes of each log copied to --out
CLEANUP_SECONDS = 25  # of --time-limit, kept for stopping the servers and removing the model


class TimeLimit(Exception):
    pass


def say(*parts) -> None:
    print(*parts, flush=True)


# ---------------------------------------------------------------- the model (tf-python)

def _tiny_model():
    spec = importlib.util.spec_from_file_location("tiny_model", TINY_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def widen_tokenizer(tok, vocab_size: int):
    """``tok`` (a trained BPE) with ids up to ``vocab_size``: each added id is an entry of
    the BPE vocabulary that no merge reaches (prompts never encode to it) and that
    decodes to a text of its own (`` w0``, `` w1``, ...)."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise SystemExit("the trained vocabulary's ids are not 0..n-1")
    i = 0
    while len(vocab) < vocab_size:
        piece = f" w{i}"
        i += 1
        if piece not in vocab:
            vocab[piece] = len(vocab)
    wide = Tokenizer.from_str(json.dumps(data))
    if wide.get_vocab_size() != vocab_size:
        raise SystemExit(f"widened tokenizer has {wide.get_vocab_size()} ids, not {vocab_size}")
    return wide


def build_model(out: Path, size: str, device: str) -> None:
    """Write a loadable model folder at ``out`` (via ``out.tmp``, renamed when complete)."""
    t0 = time.monotonic()
    tm = _tiny_model()
    if size == "tiny":
        tm.build(out, "tiny")
        say(f"[build] tiny model ({tm.SIZES['tiny']}) built in {time.monotonic() - t0:.1f}s")
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, inter, layers, heads, kv, head_dim, vocab, positions = SHAPES[size]
    say(f"[build] imports {time.monotonic() - t0:.1f}s; torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(0)})" if device.startswith("cuda") else ""))
    t_imp = time.monotonic()
    rng = random.Random(tm.SEED)
    tok = widen_tokenizer(tm.build_tokenizer(rng), vocab)
    tm.check_tokens(tok)
    eos = tok.token_to_id(tm.EOS)
    t_tok = time.monotonic()
    say(f"[build] tokenizer: {tok.get_vocab_size()} ids, eos {eos}, {t_tok - t_imp:.1f}s")

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=tm.EOS, pad_token=tm.EOS,
                                   model_max_length=positions)
    fast.chat_template = tm.CHAT_TEMPLATE
    fast.save_pretrained(tmp)

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        head_dim=head_dim, max_position_embeddings=positions, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        rms_norm_eps=1e-5, attention_bias=False, mlp_bias=False,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=False)
    config.dtype = torch.bfloat16
    # No initialisation pass: the parameters are laid out on the meta device in bf16,
    # given storage on the target device (to_empty) and filled there in place.
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(tm.SEED)
    n_params = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype != torch.bfloat16:
                raise SystemExit(f"{name} is {p.dtype}, not bfloat16")
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
            n_params += p.numel()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t_init = time.monotonic()
    say(f"[build] {n_params / 1e9:.2f}B parameters in bf16 on {device} in {t_init - t_tok:.1f}s")
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos}, indent=1))
    t_save = time.monotonic()
    nbytes = sum(f.stat().st_size for f in tmp.iterdir())
    saved = json.loads((tmp / "config.json").read_text())
    say(f"[build] saved {nbytes / 2**30:.2f} GiB ({sorted(f.name for f in tmp.iterdir())}) "
        f"in {t_save - t_init:.1f}s; config dtype {saved.get('dtype', saved.get('torch_dtype'))}"
        f", rope {saved.get('rope_parameters', saved.get('rope_theta'))}")
    del model
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    say(f"[build] model built in {time.monotonic() - t0:.1f}s")


# ---------------------------------------------------------------- helpers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def parse_metrics(text: str) -> list[tuple[str, dict, float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2] or ""))
        with contextlib.suppress(ValueError):
            out.append((m[1], labels, float(m[3])))
    return out


def total(samples, name: str, **labels) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels``; None if none."""
    values = [v for n, lab, v in samples
              if n == name and all(lab.get(k) == w for k, w in labels.items())]
    return sum(values) if values else None


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def r4(x):
    return None if x is None else (round(x, 4) if isinstance(x, float) else x)


# ---------------------------------------------------------------- GPU sampling (NVML)

class GpuSampler:
    """NVML once a second in a thread: utilisation, memory, power, and where the GPU and
    driver allow it GPM's DRAM bandwidth, any-tensor and SM utilisation (percent)."""

    GPM = (("dram_bw_util", "NVML_GPM_METRIC_DRAM_BW_UTIL"),
           ("any_tensor_util", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
           ("sm_util", "NVML_GPM_METRIC_SM_UTIL"))

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.rows: list[dict] = []
        self.errors: list[str] = []
        self.nvml = self.handle = None
        self.why_not: str | None = None
        self.gpm_why_not: str | None = None
        self.gpm_ids: list[tuple[str, int]] = []
        self.device = None
        try:
            import pynvml
        except ImportError:
            self.why_not = "nvidia-ml-py (pynvml) is not installed"
            self.gpm_why_not = self.why_not
            return
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.device = name.decode() if isinstance(name, bytes) else str(name)
            self.nvml = pynvml
        except Exception as e:  # NVMLError: no library, no driver, no GPU
            self.why_not = f"NVML unavailable: {type(e).__name__}: {e}"
            self.gpm_why_not = self.why_not
            return
        try:
            self.gpm_ids = [(k, getattr(pynvml, c)) for k, c in self.GPM]
            support = pynvml.nvmlGpmQueryDeviceSupport(self.handle)
            if not support.isSupportedDevice:
                self.gpm_why_not = "nvmlGpmQueryDeviceSupport: this device has no GPM"
        except AttributeError as e:
            self.gpm_why_not = f"this nvidia-ml-py has no GPM API ({e})"
        except Exception as e:
            self.gpm_why_not = f"nvmlGpmQueryDeviceSupport failed: {type(e).__name__}: {e}"

    def start(self) -> None:
        self.rows: list[dict] = []
        self.errors: list[str] = []
        if self.nvml is None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _gpm_get(self, s1, s2) -> dict:
        N = self.nvml
        mg = N.c_nvmlGpmMetricsGet_t()
        mg.version = N.NVML_GPM_METRICS_GET_VERSION
        mg.numMetrics = len(self.gpm_ids)
        mg.sample1, mg.sample2 = s1, s2
        for i, (_, mid) in enumerate(self.gpm_ids):
            mg.metrics[i].metricId = mid
        N.nvmlGpmMetricsGet(mg)
        out = {}
        for i, (key, _) in enumerate(self.gpm_ids):
            m = mg.metrics[i]
            if m.nvmlReturn == 0:
                out[key] = float(m.value)
            elif len(self.errors) < 5:
                self.errors.append(f"GPM {key}: nvmlReturn {m.nvmlReturn}")
        return out

    def _run(self) -> None:
        N, h = self.nvml, self.handle
        samples = None
        if self.gpm_why_not is None:
            try:
                samples = [N.nvmlGpmSampleAlloc(), N.nvmlGpmSampleAlloc()]
                N.nvmlGpmSampleGet(h, samples[0])
                held_at = time.time()  # when the sample kept for the next reading was taken
            except Exception as e:
                self.gpm_why_not = f"GPM sampling failed: {type(e).__name__}: {e}"
                samples = None
        try:
            while not self._stop.wait(1.0):
                row = {"t": time.time()}
                try:
                    u = N.nvmlDeviceGetUtilizationRates(h)
                    mem = N.nvmlDeviceGetMemoryInfo(h)
                    row |= {"gpu_util": float(u.gpu), "mem_util": float(u.memory),
                            "mem_used_gib": mem.used / 2**30,
                            "power_w": N.nvmlDeviceGetPowerUsage(h) / 1000.0}
                except Exception as e:
                    if len(self.errors) < 5:
                        self.errors.append(f"NVML: {type(e).__name__}: {e}")
                if samples is not None:
                    try:
                        N.nvmlGpmSampleGet(h, samples[1])
                        now = time.time()
                        row |= self._gpm_get(samples[0], samples[1]) | {"since": held_at}
                        samples.reverse()
                        held_at = now
                    except Exception as e:
                        self.gpm_why_not = f"GPM sampling failed: {type(e).__name__}: {e}"
                        samples = None
                self.rows.append(row)
        finally:
            if samples is not None:
                for s in samples:
                    with contextlib.suppress(Exception):
                        N.nvmlGpmSampleFree(s)

    def stop(self) -> dict:
        if self._thread is not None:
            self._stop.set()
            self._thread.join(5)
            self._thread = None
        if self.nvml is None:
            return {"available": False, "why": self.why_not}
        keys = ("gpu_util", "mem_util", "mem_used_gib", "power_w",
                *(k for k, _ in self.GPM))
        means = {}
        for k in keys:
            vals = [r[k] for r in self.rows if k in r]
            if vals:
                means[k] = round(statistics.fmean(vals), 2)
        return {"available": True, "device": self.device, "samples": len(self.rows),
                "means": means, "gpm": self.gpm_why_not is None,
                "gpm_why_not": self.gpm_why_not, "errors": self.errors}

    def over(self, lo: float, hi: float) -> dict:
        """This sampler's GPM means over ``[lo, hi]`` (the roofline estimate's range), each
        reading (from the sample before it) by the part of it inside: the second opinion
        on phasewatch's own counters over the same range."""
        out = {}
        for k, _ in self.GPM:
            got = [(r[k], min(r["t"], hi) - max(r["since"], lo)) for r in self.rows
                   if k in r]
            got = [(v, w) for v, w in got if w > 0]
            if got:
                out[k] = round(sum(v * w for v, w in got) / sum(w for _, w in got), 2)
        return out

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        if self.nvml is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()


# ---------------------------------------------------------------- the load

async def load(url: str, seconds: float, streams: int, max_tokens: int, tag: str,
               request_timeout: float, once: bool = False) -> dict:
    """``streams`` clients, each streaming one chat completion after another for
    ``seconds`` (the one under way at the end is read to its end); ``once``: one
    request each, whatever the time."""
    import aiohttp

    st = {"sent": 0, "finished": 0, "failed": 0, "statuses": {}, "errors": [],
          "ttft": [], "e2e": [], "chunks": 0, "completion_tokens": 0, "prompt_tokens": 0,
          "no_usage": 0}
    start = time.monotonic()
    deadline = start + seconds

    async def one(session, k: int) -> None:
        n = 0
        while (n == 0) if once else (time.monotonic() < deadline):
            n += 1
            body = {"messages": [{"role": "user", "content": f"{tag}-{k}-{n} {PROMPT}"}],
                    "max_tokens": max_tokens, "stream": True}
            st["sent"] += 1
            t0 = time.monotonic()
            first, finished, usage = None, False, None
            try:
                async with session.post(url, json=body) as r:
                    st["statuses"][str(r.status)] = st["statuses"].get(str(r.status), 0) + 1
                    if r.status != 200:
                        raw = await r.read()
                        st["failed"] += 1
                        if len(st["errors"]) < 5:
                            st["errors"].append(f"{r.status}: {raw[:300]!r}")
                        continue
                    async for line in r.content:
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if not payload or payload == b"[DONE]":
                            continue
                        obj = json.loads(payload)
                        for ch in obj.get("choices") or []:
                            if (ch.get("delta") or {}).get("content"):
                                st["chunks"] += 1
                                if first is None:
                                    first = time.monotonic()
                            if ch.get("finish_reason"):
                                finished = True
                        if obj.get("usage"):
                            usage = obj["usage"]
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                st["failed"] += 1
                if len(st["errors"]) < 5:
                    st["errors"].append(repr(e)[:300])
                continue
            if finished:
                st["finished"] += 1
                st["e2e"].append(time.monotonic() - t0)
                if first is not None:
                    st["ttft"].append(first - t0)
                if usage:
                    st["completion_tokens"] += usage.get("completion_tokens") or 0
                    st["prompt_tokens"] += usage.get("prompt_tokens") or 0
                else:
                    st["no_usage"] += 1
            else:
                st["failed"] += 1
                if len(st["errors"]) < 5:
                    st["errors"].append("stream ended without a finish_reason")

    timeout = aiohttp.ClientTimeout(total=request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(one(session, k) for k in range(streams)))
    took = time.monotonic() - start
    ttft, e2e = st.pop("ttft"), st.pop("e2e")
    st |= {"streams": streams, "seconds": round(took, 2),
           "ttft_p50": r4(quantile(ttft, 0.5)), "ttft_p90": r4(quantile(ttft, 0.9)),
           "e2e_mean": r4(statistics.fmean(e2e)) if e2e else None,
           "output_tokens_per_second": round(st["completion_tokens"] / took, 1),
           "chunks_per_second": round(st["chunks"] / took, 1)}
    return st


# ---------------------------------------------------------------- the check

class Check:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out = Path(a.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.run_limit  # the rest of --time-limit: the cleanup
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.summary: dict = {"args": vars(a), "ok": False, "timings": {}, "phases": [],
                              "notes": []}
        self.work: Path | None = None
        self.own_work = False
        self.model_dir: Path | None = None
        self.sampler: GpuSampler | None = None
        self.mode = "eager"  # transformers serve's: eager, or graphs (--cb-use-cuda-graph)
        self.deployment: dict | None = None  # the roofline entry's, for calibrate's check
        self.calibrated: dict | None = None

    # -- time

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def lap(self, key: str, since: float) -> float:
        took = round(time.monotonic() - since, 2)
        self.summary["timings"][key] = took
        return took

    # -- processes

    def spawn(self, name: str, cmd: list[str], env: dict | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        log = self.work / f"{name}.log"
        self.logs[name] = log
        with open(log, "w") as f:
            f.write(shlex.join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    env=env or os.environ.copy(), cwd=cwd or self.work,
                                    start_new_session=True)
        self.procs[name] = proc
        say(f"[{name}] pid {proc.pid}: {shlex.join(cmd)}")
        return proc

    def stop(self, name: str, timeout: float = 10.0) -> None:
        proc = self.procs.get(name)
        if proc is None:
            return
        stop_group(proc, timeout)  # SIGTERM to its group, then SIGKILL to what is left
        say(f"[{name}] stopped (exit {proc.returncode})")
        self.summary.setdefault("exit_codes", {})[name] = proc.returncode
        del self.procs[name]

    def wait_exit(self, name: str, timeout: float) -> int:
        proc = self.procs[name]
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeLimit(f"{name} still running after {timeout:.0f}s") from None
        del self.procs[name]
        return rc

    def tail(self, name: str, n: int = 4000) -> str:
        log = self.logs.get(name)
        return log.read_text(errors="replace")[-n:] if log and log.exists() else ""

    def echo_log(self, name: str, prefix: str) -> None:
        for line in (self.logs[name].read_text(errors="replace").splitlines()[1:]):
            if line.startswith(prefix):
                say(line)

    # -- steps

    def versions(self) -> None:
        code = ("import importlib.metadata as m, json, sys\n"
                "out = {'python': sys.version.split()[0]}\n"
                "for p in sys.argv[1:]:\n    try: out[p] = m.version(p)\n"
                "    except m.PackageNotFoundError: out[p] = None\nprint(json.dumps(out))")
        for key, py in (("tf_python", self.a.tf_python), ("pw_python", self.a.pw_python)):
            try:
                r = subprocess.run([py, "-c", code, *VERSIONS], capture_output=True, text=True,
                                   timeout=30)
                got = json.loads(r.stdout) if r.returncode == 0 else {"error": r.stderr[-500:]}
            except Exception as e:
                got = {"error": repr(e)}
            self.summary.setdefault("versions", {})[key] = got
            say(f"[versions] {key} ({py}): "
                + ", ".join(f"{k} {v}" for k, v in got.items() if v))
        self.phasewatch_source()
        with contextlib.suppress(Exception):
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=20)
            if r.returncode == 0:
                self.summary["nvidia_smi"] = r.stdout.strip()
                say(f"[versions] nvidia-smi: {r.stdout.strip()}")

    def phasewatch_source(self) -> None:
        """Whether the phasewatch that --pw-python imports is this checkout's code (a wheel
        built before the last edit would not be)."""
        try:
            r = subprocess.run([self.a.pw_python, "-c", "import os, phasewatch; "
                                "print(os.path.dirname(os.path.abspath(phasewatch.__file__)))"],
                               capture_output=True, text=True, timeout=30,
                               cwd=tempfile.gettempdir())
            installed = Path(r.stdout.strip())
            if r.returncode != 0 or not installed.is_dir():
                raise RuntimeError(r.stderr[-300:])
        except Exception as e:
            self.summary["phasewatch_source"] = f"not checked: {e}"
            say(f"[versions] phasewatch source not checked: {e}")
            return
        # what the imports resolve to (a PYTHONPATH overlay can lose to a site-packages
        # package of the same name, e.g. a regular `google` package hiding the protobuf)
        probe = ("import json, google.protobuf as pb, grpc, pydantic; "
                 "import opentelemetry.sdk.trace as o; "
                 "print(json.dumps({'protobuf': [pb.__version__, pb.__file__], "
                 "'grpc': [grpc.__version__, grpc.__file__], "
                 "'pydantic': [pydantic.VERSION, pydantic.__file__], 'otel_sdk': o.__file__}))")
        r = subprocess.run([self.a.pw_python, "-c", probe], capture_output=True, text=True,
                           timeout=60, cwd=tempfile.gettempdir())
        got = r.stdout.strip() if r.returncode == 0 else f"FAILED: {r.stderr[-600:]}"
        self.summary["pw_imports"] = got
        say(f"[versions] pw_python imports: {got}")
        differ, checked = [], 0
        for f in sorted(installed.rglob("*")):
            if f.suffix not in (".py", ".json") or "__pycache__" in f.parts:
                continue
            rel = f.relative_to(installed)
            mine = (ROOT / "dashboard" / rel.relative_to("dashboard") if rel.parts[0] == "dashboard"
                    else ROOT / "exporter" / rel)
            checked += 1
            if not mine.exists() or mine.read_bytes() != f.read_bytes():
                differ.append(str(rel))
        same = installed.resolve() == (ROOT / "exporter").resolve()
        self.summary["phasewatch_source"] = {"path": str(installed), "files": checked,
                                             "differ": differ}
        say(f"[versions] phasewatch from {installed}: "
            + ("the checkout itself" if same else
               f"{checked} files, all as in this checkout" if not differ else
               f"{len(differ)} of {checked} files differ from this checkout: {differ[:8]}"))

    def pick_work(self) -> None:
        need = 20 * 2**30 if self.a.size == "8b" else 2**30
        if self.a.work:
            self.work = Path(self.a.work).resolve()
            self.work.mkdir(parents=True, exist_ok=True)
        else:
            for base in (tempfile.gettempdir(), "/dev/shm", str(self.out.parent)):
                with contextlib.suppress(OSError):
                    if shutil.disk_usage(base).free > need:
                        self.work = Path(tempfile.mkdtemp(prefix="tap-check-", dir=base))
                        self.own_work = True
                        break
        if self.work is None:
            raise SystemExit(f"no folder with {need / 2**30:.0f} GiB free for the model "
                             "(--work DIR)")
        free = shutil.disk_usage(self.work).free
        say(f"[work] {self.work} ({free / 2**30:.0f} GiB free)")
        if free < need:
            raise SystemExit(f"{self.work}: {free / 2**30:.1f} GiB free, the model needs "
                             f"{need / 2**30:.0f}")

    def build(self) -> None:
        self.model_dir = self.work / MODEL_DIRS[self.a.size]
        t = time.monotonic()
        self.spawn("build", [self.a.tf_python, str(Path(__file__).resolve()), "--build-model",
                             str(self.model_dir), "--size", self.a.size,
                             "--device", self.a.device])
        rc = self.wait_exit("build", max(10.0, self.left() - 150))
        self.echo_log("build", "[build]")
        if rc != 0 or not (self.model_dir / "config.json").exists():
            raise RuntimeError(f"building the model failed ({rc}):\n{self.tail('build')}")
        took = self.lap("build_model_s", t)
        say(f"[build] the model folder took {took:.1f}s in all (imports included)")

    def calibrate(self) -> Path:
        """A CPU hardware profile, as tests/real/test_real_transformers.py measures it (with
        torch: in --tf-python, which must import phasewatch too)."""
        if self.a.hardware_profile:
            return Path(self.a.hardware_profile)
        out = self.work / "cpu-profile.json"
        t = time.monotonic()
        self.spawn("calibrate", [self.a.tf_python, "-c",
                                 "import sys; from phasewatch.roofline import calibrate as c; "
                                 "p = c.calibrate('cpu', 256, 1024, 3); c.write(p, sys.argv[1])",
                                 str(out)])
        rc = self.wait_exit("calibrate", min(300.0, self.left()))
        if rc != 0:
            raise RuntimeError(f"calibrate failed:\n{self.tail('calibrate')}")
        say(f"[calibrate] {out} in {self.lap('calibrate_s', t):.1f}s")
        return out

    def calibrate_gpu(self) -> dict | None:
        """``phasewatch calibrate`` on the GPU (bandwidth and bf16/fp16/fp32 FLOP/s), kept
        to compare with the datasheet serve --hardware auto finds."""
        out = self.work / "gpu-profile.json"
        t = time.monotonic()
        self.spawn("calibrate", [self.a.pw_python, "-m", "phasewatch.cli", "calibrate",
                                 "--device", "cuda", "--matmul-n", "8192", "--size-mib", "4096",
                                 "--matmul-seconds", "4", "--output", str(out)])
        rc = self.wait_exit("calibrate", min(150.0, max(10.0, self.left() - 240)))
        self.echo_log("calibrate", "calibrate")
        if rc != 0 or not out.exists():
            self.summary["notes"].append(f"calibrate failed ({rc})")
            say(f"[calibrate] failed ({rc}):\n{self.tail('calibrate')}")
            return None
        shutil.copy(out, self.out / "gpu-profile.json")
        say(f"[calibrate] {out} in {self.lap('calibrate_gpu_s', t):.1f}s")
        return json.loads(out.read_text())

    def start_transformers(self) -> str:
        port = free_port()
        hf = self.work / "hf"
        (hf / "hub").mkdir(parents=True, exist_ok=True)  # /v1/models answers 500 without it
        env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1",
               "TRANSFORMERS_OFFLINE": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false",
               "PYTHONUNBUFFERED": "1"}
        # the `transformers` console script's app, without its update check (no network)
        cmd = [self.a.tf_python, "-c",
               "import sys; from transformers.cli.transformers import app; "
               "sys.exit(app(prog_name='transformers'))",
               "serve", str(self.model_dir), "--device", self.a.device,
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "info",
               "--continuous-batching", *shlex.split(self.a.cb_flags),
               *(["--cb-use-cuda-graph"] if self.mode == "graphs" else [])]
        if self.a.device == "cpu":
            cmd += ["--dtype", "float32"]
        t = time.monotonic()
        proc = self.spawn("transformers", cmd, env=env)
        base = f"http://127.0.0.1:{port}"
        limit = min(self.a.serve_timeout, max(10.0, self.left() - 120))
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited ({proc.returncode}) while "
                                   f"starting:\n{self.tail('transformers')}")
            with contextlib.suppress(OSError, ValueError):
                if json.loads(http_get(base + "/health", 2)).get("status") == "ok":
                    break
            if time.monotonic() - t > limit:
                raise TimeLimit(f"transformers serve not ready after {limit:.0f}s:\n"
                                + self.tail("transformers"))
            time.sleep(0.25)
        say(f"[transformers] ready at {base} in {self.lap('transformers_ready_s', t):.1f}s")
        return base

    def warm_up(self, base: str) -> None:
        """Requests straight to the server (phasewatch does not see them): the first one
        sets up continuous batching (its cache, any CUDA graphs), then as many at once as
        the largest phase."""
        t = time.monotonic()
        url = base + "/v1/chat/completions"
        one = asyncio.run(load(url, 0, 1, 16, "warm", 300, once=True))
        say(f"[warm-up] 1 request: {one['finished']} finished, {one['failed']} failed "
            f"in {one['seconds']}s {one['errors'][:1]}")
        if one["finished"] != 1:
            raise RuntimeError(f"the warm-up request failed: {one['errors']}\n"
                               + self.tail("transformers"))
        many = max(self.a.streams)
        burst = asyncio.run(load(url, 0, many, 32, "warm", 300, once=True))
        say(f"[warm-up] {many} at once: {burst['finished']} finished, {burst['failed']} failed "
            f"in {burst['seconds']}s")
        self.summary["warm_up"] = {"one": one, "burst": burst}
        self.lap("warm_up_s", t)

    def start_phasewatch(self, upstream: str) -> dict:
        args = [self.a.pw_python, "-m", "phasewatch.cli", "serve", *PW_FREE,
                "--tap-upstream", upstream, "--tap-port", "0",
                "--hf-config", str(self.model_dir / "config.json"),
                "--window-seconds", "30", "--roofline-interval", "1",
                # the GPU's own counters, read by phasewatch itself (none on a CPU: the
                # reads are counted by reason)
                "--gpu-nvml", "true"]
        if self.a.device == "cpu":
            args += ["--weight-dtype", "fp32", "--kv-dtype", "fp32",
                     "--hardware-profile", str(self.calibrate())]
        else:
            args += ["--hardware", self.a.hardware]
        t = time.monotonic()
        proc = self.spawn("phasewatch", args)
        while True:
            text = self.logs["phasewatch"].read_text(errors="replace")
            found = {k: re.search(p, text) for k, p in PW_PATTERNS.items()}
            if all(found.values()):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"phasewatch serve exited ({proc.returncode}):\n{text[-4000:]}")
            if time.monotonic() - t > 60:
                raise TimeLimit(f"phasewatch serve did not start in 60s:\n{text[-4000:]}")
            time.sleep(0.1)
        ports = {k: int(m[1]) for k, m in found.items()}
        say(f"[phasewatch] ready in {self.lap('phasewatch_ready_s', t):.1f}s: {ports}")
        self.summary["phasewatch_ports"] = ports
        warnings = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
        self.summary["phasewatch_warnings"] = warnings
        for line in warnings:
            say(f"[phasewatch] {line}")
        return ports

    def phase(self, streams: int, ports: dict, before: list) -> list:
        seconds = min(self.a.seconds, self.left() - 45)
        if seconds < 5:
            self.summary["notes"].append(f"phase {streams} skipped: {self.left():.0f}s left")
            say(f"[phase {streams}] skipped: {self.left():.0f}s left of the time limit")
            return before
        if seconds < self.a.seconds:
            self.summary["notes"].append(f"phase {streams} shortened to {seconds:.0f}s")
        say(f"\n[phase {self.mode} {streams}] {streams} streaming clients for {seconds:.0f}s "
            "through the tap")
        self.sampler.start()
        try:
            client = asyncio.run(load(f"http://127.0.0.1:{ports['tap_port']}/v1/chat/completions",
                                      seconds, streams, self.a.max_tokens, f"p{streams}",
                                      max(30.0, min(180.0, self.left() - 20))))
        finally:
            gpu = self.sampler.stop()
        time.sleep(self.a.settle)  # the tap hands its records over every 0.25 s; a roofline tick
        pw = f"http://127.0.0.1:{ports['http_port']}"
        roof_raw = http_get(pw + "/api/v1/roofline")
        metrics_raw = http_get(pw + "/metrics")
        tag = f"{self.mode}-{streams}"
        (self.out / f"roofline-{tag}.json").write_bytes(roof_raw)
        (self.out / f"metrics-{tag}.txt").write_bytes(metrics_raw)
        roof = json.loads(roof_raw)
        text = metrics_raw.decode(errors="replace")
        samples = parse_metrics(text)

        def count(name, **labels):
            """The sum; 0 for a declared counter with no series yet, None if undeclared."""
            got = total(samples, name, **labels)
            if got is None and f"# TYPE {name} " in text:
                return 0.0
            return got

        def delta(name, **labels):
            now, was = count(name, **labels), total(before, name, **labels)
            return None if now is None else now - (was or 0.0)

        counters = {
            "tap_completed": delta("phasewatch_tap_requests_total", outcome="completed"),
            "tap_requests_by_outcome": {
                lab.get("outcome"): v for n, lab, v in samples
                if n == "phasewatch_tap_requests_total"},
            "accepted_tap": delta("phasewatch_ingest_accepted_total", protocol="tap"),
            "rejected": count("phasewatch_ingest_rejected_total"),
            "token_times_dropped": count("phasewatch_tap_token_times_dropped_total"),
            "records_dropped": count("phasewatch_tap_records_dropped_total"),
            "model_unmatched": count("phasewatch_model_unmatched_requests_total"),
            "no_roofline": count("phasewatch_no_roofline_requests_total"),
        }
        entries = roof.get("models") or []
        entry = next((e for e in entries if e.get("configured")), entries[0] if entries else None)
        got = {"streams": streams, "mode": self.mode, "client": client, "counters": counters,
               "gpu": gpu, "gpu_check": gpu_block(entry),
               "gpu_reads": {lab.get("result"): v for n, lab, v in samples
                             if n == "phasewatch_gpu_counter_reads_total"},
               "roofline_models": [e.get("model") for e in entries]}
        est_range = ((entry or {}).get("estimate") or {})
        if est_range.get("range_start") is not None:
            got["gpu_over_range"] = self.sampler.over(est_range["range_start"],
                                                      est_range["range_end"])
        if entry is not None and entry.get("deployment"):
            self.deployment = entry["deployment"]
        if entry is not None:
            est, v, dep = entry.get("estimate") or {}, entry.get("verdict"), entry.get("deployment")
            dec = est.get("decode") or {}
            pre = est.get("prefill") or {}
            got["roofline"] = {
                "model": entry.get("model"), "engine": entry.get("engine"),
                "configured": entry.get("configured"),
                "hardware": dep and dep.get("hardware"),
                "hardware_source": dep and dep.get("hardware_source"),
                "peak_bandwidth": dep and dep.get("peak_bandwidth_bytes_per_second"),
                "weight_dtype": dep and dep.get("weight_dtype"),
                "requests": est.get("requests"),
                "decode_mbu": dec.get("bandwidth_utilization"),
                "decode_mfu": dec.get("flops_utilization"),
                "decode_bytes_per_second": dec.get("achieved_bytes_per_second"),
                "decode_ceiling_exceeded": dec.get("ceiling_exceeded"),
                "prefill_mfu": pre.get("flops_utilization"),
                "decode_batch_size": est.get("decode_batch_size"),
                "decode_step_seconds": est.get("decode_step_seconds"),
                "decode_step_roofline_seconds": est.get("decode_step_roofline_seconds"),
                "phases_input": (est.get("inputs") or {}).get("phases"),
                "verdict": None if v is None else {
                    k: v.get(k) for k in ("headline", "phase", "resource", "cause",
                                          "confidence", "view", "text", "levers")}
                | {"decode_step_seconds": (v.get("evidence") or {}).get("decode_step_seconds")},
            }
        self.summary["phases"].append(got)
        self.report(got)
        return samples

    def report(self, got: dict) -> None:
        c, k, g = got["client"], got["counters"], got["gpu"]
        say(f"[phase {got['mode']} {got['streams']}] clients: sent {c['sent']}, "
            f"finished {c['finished']}, "
            f"failed {c['failed']} {c['statuses']} in {c['seconds']}s; "
            f"{c['completion_tokens']} output tokens ({c['output_tokens_per_second']}/s), "
            f"{c['chunks']} chunks; TTFT p50 {c['ttft_p50']}s p90 {c['ttft_p90']}s, "
            f"e2e mean {c['e2e_mean']}s")
        if c["errors"]:
            say(f"  client errors: {c['errors']}")
        say(f"  tap completed {k['tap_completed']} (all outcomes {k['tap_requests_by_outcome']}),"
            f" accepted {k['accepted_tap']}, rejected {k['rejected']}, token_times_dropped "
            f"{k['token_times_dropped']}, records_dropped {k['records_dropped']}, "
            f"model_unmatched {k['model_unmatched']}, no_roofline {k['no_roofline']}")
        r = got.get("roofline")
        if r is None:
            say(f"  roofline: no entry (models {got['roofline_models']})")
        else:
            bw = r["peak_bandwidth"]
            say(f"  roofline: model {r['model']!r} configured {r['configured']}, hardware "
                f"{r['hardware']} ({r['hardware_source']}, "
                f"{bw / 1e12 if bw else float('nan'):.2f} TB/s), {r['requests']} requests; "
                f"decode MBU {r4(r['decode_mbu'])} MFU {r4(r['decode_mfu'])}, "
                f"batch {r4(r['decode_batch_size'])}, "
                f"decode_step_seconds {r4(r['decode_step_seconds'])} "
                f"(roofline {r4(r['decode_step_roofline_seconds'])}); "
                f"inputs.phases {r['phases_input']}"
                + (f"; ceiling exceeded {r['decode_ceiling_exceeded']}"
                   if r["decode_ceiling_exceeded"] else ""))
            v = r["verdict"]
            if v is None:
                say("  verdict: none")
            else:
                say(f"  verdict: {v['headline']} ({v['phase']}/{v['resource']}, cause "
                    f"{v['cause']}, confidence {v['confidence']}, view {v['view']})\n"
                    f"    {v['text']}\n    levers: {v['levers']}")
        say(f"  {gpu_line(got['gpu_check'])}; reads {got['gpu_reads']}")
        if g.get("available"):
            say(f"  GPU ({g['device']}, {g['samples']} samples): means {g['means']}"
                + (f"; over the estimate's range {got['gpu_over_range']}"
                   if got.get("gpu_over_range") else "")
                + ("" if g["gpm"] else f"; no GPM: {g['gpm_why_not']}")
                + (f"; errors {g['errors']}" if g["errors"] else ""))
        else:
            say(f"  GPU sampling unavailable: {g.get('why')}")

    # -- the whole

    def run(self) -> int:
        code = 1
        try:
            self.pick_work()
            self.versions()
            self.sampler = GpuSampler()
            self.summary["nvml"] = {"device": self.sampler.device, "why_not": self.sampler.why_not,
                                    "gpm_why_not": self.sampler.gpm_why_not}
            say(f"[nvml] device {self.sampler.device}; "
                + (self.sampler.why_not or "NVML ok") + "; GPM: "
                + (self.sampler.gpm_why_not or "supported"))
            self.build()
            profile = self.calibrate_gpu() if self.a.device.startswith("cuda") else None
            for mode in self.a.modes:
                self.run_mode(mode)
            if profile is not None:
                self.calibrated = calibrate_vs_datasheet(profile, self.deployment)
                self.summary["calibrate"] = self.calibrated
                say(f"[calibrate] {calibrate_line(self.calibrated)}")
            self.recap()
            why = failures(self.summary["phases"], self.a.device.startswith("cuda"),
                           self.calibrated)
            self.summary["failures"] = why
            for line in why:
                say(f"[fail] {line}")
            self.summary["ok"] = not why
            code = 0 if not why else 1
        except TimeLimit as e:
            self.summary["error"] = f"time limit: {e}"
            say(f"[error] time limit ({self.a.time_limit:.0f}s): {e}")
        except KeyboardInterrupt:
            self.summary["error"] = "interrupted"
            say("[error] interrupted")
        except BaseException as e:
            self.summary["error"] = "".join(traceback.format_exception(e))[-4000:]
            say(f"[error] {type(e).__name__}: {e}")
            traceback.print_exc()
        finally:
            signal.alarm(0)
            self.cleanup()
        return code

    def run_mode(self, mode: str) -> None:
        """transformers serve in ``mode`` with phasewatch's tap in front, each phase's
        streams through it; both stopped after, their logs kept under the mode's name."""
        self.mode = mode
        if self.left() < 90:
            self.summary["notes"].append(f"mode {mode} skipped: {self.left():.0f}s left")
            say(f"[mode {mode}] skipped: {self.left():.0f}s left of the time limit")
            return
        say(f"\n[mode {mode}] transformers serve --continuous-batching"
            + (" --cb-use-cuda-graph" if mode == "graphs" else ""))
        upstream = self.start_transformers()
        self.warm_up(upstream)
        ports = self.start_phasewatch(upstream)
        samples: list = []
        for streams in self.a.streams:
            samples = self.phase(streams, ports, samples)
        for name in ("phasewatch", "transformers"):
            self.stop(name)
            log = self.logs.pop(name)
            kept = log.with_name(f"{name}-{mode}.log")
            log.rename(kept)
            self.logs[f"{name}-{mode}"] = kept

    def recap(self) -> None:
        say("\n[recap] mode | streams | sent/finished | tap completed/accepted/rejected | "
            "out tok/s | TTFT p50 | decode MBU | step s | batch | verdict | GPM dram/tensor/sm %")
        for g in self.summary["phases"]:
            c, k, r = g["client"], g["counters"], g.get("roofline") or {}
            v = r.get("verdict") or {}
            m = (g["gpu"] or {}).get("means") or {}
            say(f"[recap] {g['mode']} | {g['streams']} | {c['sent']}/{c['finished']} | "
                f"{k['tap_completed']}/"
                f"{k['accepted_tap']}/{k['rejected']} | {c['output_tokens_per_second']} | "
                f"{c['ttft_p50']} | {r4(r.get('decode_mbu'))} | {r4(r.get('decode_step_seconds'))}"
                f" | {r4(r.get('decode_batch_size'))} | {v.get('phase')}/{v.get('resource')}"
                f" ({v.get('cause')}) | {m.get('dram_bw_util')}/{m.get('any_tensor_util')}/"
                f"{m.get('sm_util')} | {gpu_line(g.get('gpu_check'))}")

    def cleanup(self) -> None:
        # nothing may interrupt the cleanup: signals that end the run are ignored now
        for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            with contextlib.suppress(Exception):
                signal.signal(s, signal.SIG_IGN)
        for name in ("phasewatch", "transformers", "calibrate", "build"):
            with contextlib.suppress(Exception):
                self.stop(name)
        for name in list(self.procs):
            with contextlib.suppress(Exception):
                self.stop(name)
        if self.sampler is not None:
            self.sampler.close()
        for name, log in self.logs.items():
            with contextlib.suppress(OSError):
                data = log.read_bytes()
                (self.out / f"{name}.log").write_bytes(data[-LOG_TAIL:])
        if self.work is not None and self.model_dir is not None and not self.a.keep_model:
            for d in (self.model_dir, self.model_dir.with_name(self.model_dir.name + ".tmp")):
                shutil.rmtree(d, ignore_errors=True)
        if self.own_work and not self.a.keep_model:
            shutil.rmtree(self.work, ignore_errors=True)
        self.summary["timings"]["total_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "summary.json").write_text(json.dumps(self.summary, indent=1, default=str))
        say(f"\n[done] ok={self.summary['ok']} in {self.summary['timings']['total_s']}s; "
            f"{self.out}/summary.json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for summary.json, roofline-MODE-N.json, "
                   "metrics-MODE-N.txt, gpu-profile.json, logs")
    p.add_argument("--size", choices=("8b", "mini", "tiny"), default="8b",
                   help="8b: Llama-3.1-8B's shape in bf16 on the GPU (default); tiny, mini: "
                        "small models served in float32 on the CPU")
    p.add_argument("--device", help="--device of transformers serve (cuda for 8b, else cpu)")
    p.add_argument("--seconds", type=float, default=None,
                   help="seconds of each phase (default 20 for the 8B, 35 otherwise)")
    p.add_argument("--modes", default=None, help="transformers serve's modes, in turn: eager, "
                   "graphs (--cb-use-cuda-graph); default eager,graphs on a GPU, eager on a CPU")
    p.add_argument("--streams", default="8,48", help="concurrent clients of each phase")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--tf-python", default="python3",
                   help="Python that builds the model and runs transformers serve")
    p.add_argument("--pw-python", default="python3", help="Python that runs phasewatch serve")
    p.add_argument("--cb-flags", default=None,
                   help="--cb-* flags of transformers serve, one string (default: none on a "
                        f"GPU, its cache sized from memory; '{CPU_CB_FLAGS}' on the CPU)")
    p.add_argument("--hardware", default="auto", help="phasewatch --hardware on a GPU")
    p.add_argument("--hardware-profile", help="on the CPU: a calibrate profile (else measured)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for everything, the cleanup's last "
                        f"{CLEANUP_SECONDS}s included (default 420 for 8b, 1200 on the CPU)")
    p.add_argument("--serve-timeout", type=float, default=240.0,
                   help="seconds transformers serve may take to answer /health")
    p.add_argument("--settle", type=float, default=3.5,
                   help="seconds between a phase's end and reading phasewatch")
    p.add_argument("--work", help="folder for the model and logs (default: a new temporary one, "
                                  "removed at the end)")
    p.add_argument("--keep-model", action="store_true", help="do not remove the model folder")
    p.add_argument("--build-model", metavar="DIR", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.device = a.device or ("cuda" if a.size == "8b" else "cpu")
    if a.build_model:
        build_model(Path(a.build_model), a.size, a.device)
        return 0
    if not a.out:
        p.error("--out is required")
    a.streams = [int(s) for s in a.streams.split(",") if s.strip()]
    if a.modes is None:
        a.modes = "eager,graphs" if a.device.startswith("cuda") else "eager"
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.seconds is None:
        a.seconds = 20.0 if a.size == "8b" else 35.0
    # the processes run in the work folder: a path given relative to here, made absolute
    # (not resolved: a virtualenv's python is a symlink that must stay one)
    for key in ("tf_python", "pw_python"):
        if os.sep in getattr(a, key):
            setattr(a, key, os.path.abspath(getattr(a, key)))
    if a.cb_flags is None:
        a.cb_flags = "" if a.device.startswith("cuda") else CPU_CB_FLAGS
    if a.time_limit is None:
        a.time_limit = 480.0 if a.size == "8b" else 1200.0

    def on_alarm(signum, frame):
        raise TimeLimit(f"{a.run_limit:.0f}s of the {a.time_limit:.0f}s limit passed "
                        f"({CLEANUP_SECONDS}s are kept for the cleanup)")

    def on_term(signum, frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    a.run_limit = max(5.0, a.time_limit - CLEANUP_SECONDS)
    signal.alarm(max(1, math.ceil(a.run_limit)))
    say(f"[start] {time.strftime('%Y-%m-%d %H:%M:%S')} size {a.size}, device {a.device}, "
        f"phases {a.streams} x {a.seconds:.0f}s, max_tokens {a.max_tokens}, time limit "
        f"{a.time_limit:.0f}s, python {sys.version.split()[0]}")
    return Check(a).run()


if __name__ == "__main__":
    sys.exit(main())
