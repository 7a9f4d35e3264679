#!/usr/bin/env python3
"""The wheels ``make gpu-check`` installs on a GPU machine that has no network (the
device machine lent to some sessions: Python 3.12 with torch, transformers 5.17,
grpcio, aiohttp, uvloop, pandas, prometheus-client and nvidia-ml-py, but not
OpenTelemetry, a protobuf phasewatch's generated code accepts, or ``transformers
serve``'s server). Run here, where the package registry answers::

    .venv/bin/python tests/engines/gpu_wheels.py .whl

It writes phasewatch's own wheel (this checkout) and downloads, for CPython 3.12 on
manylinux x86-64, every package phasewatch serve and ``transformers serve``'s server need
that the device lacks (``ROOTS`` and their requirements, less ``DEVICE_HAS``), each at the
version installed here (phasewatch's in ``.venv``, the server's in ``.venv-transformers``,
which ``make engines-venv`` builds), without dependencies. Old
wheels in the folder are removed first (two versions of one package stop the install).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The device image's packages (/work/.library/device/KINDS.md, "Python packages already
# there", read 2026-11-17); everything else phasewatch or the server needs travels.
# transformers and torch are the image's own (transformers 5.17.0, as .venv-transformers).
DEVICE_HAS = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
certifi charset-normalizer click cloudpickle filelock frozenlist fsspec grpcio h11 hf-xet
httpcore httpx huggingface-hub idna jinja2 markupsafe multidict numpy nvidia-ml-py packaging
pandas pillow pip prometheus-client propcache psutil pygments python-dateutil pyyaml regex
requests rich safetensors setuptools shellingham six tokenizers torch tqdm transformers
typer typing-extensions urllib3 uvloop wheel yarl zipp markdown-it-py mdurl
""".split())  # noqa: SIM905 (a list as the page gives it)
# where the closure starts: phasewatch's runtime (.venv) and the server's (.venv-transformers)
ROOTS = {"phasewatch": ("opentelemetry-sdk", "opentelemetry-proto", "googleapis-common-protos",
                        "opentelemetry-exporter-otlp-proto-grpc",
                        "opentelemetry-exporter-otlp-proto-http", "protobuf"),
         "server": ("fastapi", "uvicorn", "pydantic", "openai")}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_24_x86_64")
LIMIT = 48 << 20  # the device tool carries 64 MiB with the whole tree


def closure(python: Path, roots: tuple[str, ...]) -> dict[str, str]:
    """``roots`` and everything they need (markers evaluated for ``python``), at the
    versions installed for it, less what the device has."""
    code = r"""
import importlib.metadata as m, json, re, sys
from packaging.requirements import Requirement
seen, todo = {}, list(sys.argv[1:])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
while todo:
    name = norm(todo.pop())
    if name in seen:
        continue
    try:
        seen[name] = m.version(name)
    except m.PackageNotFoundError:
        continue
    for r in m.requires(name) or []:
        req = Requirement(r)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            todo.append(req.name)
print(json.dumps(seen))
"""
    out = subprocess.run([str(python), "-c", code, *roots], check=True, capture_output=True,
                         text=True).stdout
    return {n: v for n, v in json.loads(out).items() if n not in DEVICE_HAS}


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".whl").resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tf = ROOT / ".venv-transformers" / "bin" / "python"
    if not tf.exists():
        print(f"{tf} is missing: `make engines-venv` builds it", file=sys.stderr)
        return 2
    pins = (closure(Path(sys.executable), ROOTS["phasewatch"])
            | closure(tf, ROOTS["server"]))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(ROOT)], check=True)
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                    "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                    "cp", *platforms, "-d", str(out),
                    *(f"{n}=={v}" for n, v in sorted(pins.items()))], check=True)
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels)
    for w in wheels:
        print(f"{w.stat().st_size / 1024:9.0f} KiB  {w.name}")
    print(f"{len(wheels)} wheels, {size / 2**20:.1f} MiB in {out}")
    if size > LIMIT:
        print(f"more than {LIMIT >> 20} MiB: the device tool would not carry them",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
