"""Stream a seeded mix of requests to an OpenAI-compatible server and record what a
client sees of each, for comparison with the server's own figures.

Runs with the engine virtualenv's Python (it has the ``openai`` client)::

    .venv-vllm/bin/python tests/engines/stream_client.py --base-url http://127.0.0.1:8000/v1 \
        --model tiny-llama --eos-token-id 0 --out client.json

The mix (``plan``): chat and completions alternately; prompts of 1 to ~250 words;
``max_tokens`` from 1 to 64; every 10th request (completions) with ``n=2`` (sampled:
vLLM refuses ``n>1`` with greedy sampling); one in eight
with the end-of-sequence token favoured (finishes with ``stop`` after a few tokens),
the rest with it forbidden (``logit_bias`` -100), so every token but that one decodes
to text. Most requests carry an ``X-Request-Id`` header (vLLM builds its request id
from it); one in seven carries none, to show the id vLLM makes up.

Per request the output holds: the plan, ``sent`` (time.time and perf_counter just
before the call), every chunk (``t`` wall clock, ``pc`` perf_counter, choice
``index``, ``text``, ``token_ids`` when the server returns them, ``finish_reason``),
the response id the client saw, the usage block (``stream_options.include_usage``)
and per choice its finish reason, first-token chunk time and last chunk time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

_TEXT = (
    "the queue was long and the prefill took most of the time while decode kept the "
    "memory bandwidth busy on every step of the batch so the sidecar measured each phase "
    "of every request and reported it to prometheus with the tokens it saw"
)
WORDS = _TEXT.split()
PROMPT_WORDS = (1, 2, 5, 12, 30, 60, 120, 250)
MAX_TOKENS = (1, 1, 2, 3, 5, 8, 16, 24, 32, 48, 64)


def plan(count: int, seed: int, eos_token_id: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = "chat" if i % 2 == 0 else "completions"
        words = rng.choice(PROMPT_WORDS)
        start = rng.randrange(len(WORDS))
        prompt = " ".join(WORDS[(start + k) % len(WORDS)] for k in range(words))
        stop_early = i % 8 == 5
        n = 2 if kind == "completions" and i % 10 == 3 else 1
        out.append({
            "index": i,
            "kind": kind,
            "prompt": prompt,
            "max_tokens": 64 if i % 9 == 4 else rng.choice(MAX_TOKENS),
            "n": n,
            # greedy (0) only for n=1: vLLM refuses n>1 with greedy sampling
            "temperature": rng.choice((0.0, 0.7, 1.0) if n == 1 else (0.7, 1.0)),
            "top_p": rng.choice((1.0, 0.9)),
            "seed": seed * 1000 + i,  # vLLM's per-request sampling seed: repeatable outputs
            "logit_bias": {str(eos_token_id): 6.0 if stop_early else -100.0},
            "x_request_id": None if i % 7 == 0 else f"pw-{seed}-{i:03d}",
        })
    return out


def _chunk_text(kind: str, choice) -> str:
    if kind == "chat":
        return (choice.delta.content or "") if choice.delta is not None else ""
    return choice.text or ""


def _extra(obj, name: str):
    """A field vLLM adds beyond the OpenAI schema (kept by the client as an extra)."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


async def one(client, model: str, p: dict) -> dict:
    headers = {"X-Request-Id": p["x_request_id"]} if p["x_request_id"] else {}
    common = dict(model=model, max_tokens=p["max_tokens"], temperature=p["temperature"],
                  top_p=p["top_p"], n=p["n"], seed=p["seed"], logit_bias=p["logit_bias"],
                  stream=True,
                  stream_options={"include_usage": True}, extra_headers=headers,
                  extra_body={"return_token_ids": True})
    rec = {**p, "chunks": [], "response_id": None, "usage": None, "error": None}
    sent_t, sent_pc = time.time(), time.perf_counter()
    rec["sent"] = {"t": sent_t, "pc": sent_pc}
    try:
        if p["kind"] == "chat":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": p["prompt"]}], **common)
        else:
            stream = await client.completions.create(prompt=p["prompt"], **common)
        async for chunk in stream:
            t, pc = time.time(), time.perf_counter()
            rec["response_id"] = rec["response_id"] or chunk.id
            if chunk.usage is not None:
                details = chunk.usage.prompt_tokens_details
                rec["usage"] = {"prompt_tokens": chunk.usage.prompt_tokens,
                                "completion_tokens": chunk.usage.completion_tokens,
                                "cached_tokens": details.cached_tokens if details else None}
            for choice in chunk.choices:
                ids = _extra(choice, "token_ids")
                if ids is None and p["kind"] == "chat" and choice.delta is not None:
                    ids = _extra(choice.delta, "token_ids")
                rec["chunks"].append({
                    "t": t, "pc": pc, "index": choice.index,
                    "text": _chunk_text(p["kind"], choice),
                    "token_ids": list(ids) if ids is not None else None,
                    "finish_reason": choice.finish_reason,
                })
            if not chunk.choices:
                rec["chunks"].append({"t": t, "pc": pc, "index": None, "text": "",
                                      "token_ids": None, "finish_reason": None})
    except Exception as e:  # recorded: the test reports it
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["done"] = {"t": time.time(), "pc": time.perf_counter()}
    rec["choices"] = summarize(rec)
    return rec


def is_token_chunk(c: dict) -> bool:
    """A chunk that carries output: text, token ids, or the finish (whose token may be
    the end-of-sequence one, which has no text). A chat stream's opening role-only
    chunk is none of these."""
    return c["index"] is not None and bool(c["text"] or c["token_ids"] or c["finish_reason"])


def summarize(rec: dict) -> list[dict]:
    out = []
    for i in range(rec["n"]):
        mine = [c for c in rec["chunks"] if c["index"] == i]
        tokens = [c for c in mine if is_token_chunk(c)]
        finish = [c["finish_reason"] for c in mine if c["finish_reason"]]
        ids = [c["token_ids"] for c in tokens if c["token_ids"] is not None]
        out.append({
            "index": i,
            "finish_reason": finish[-1] if finish else None,
            "token_chunks": len(tokens),
            "token_ids": sum(len(x) for x in ids) if ids else None,
            "first_token": {"t": tokens[0]["t"], "pc": tokens[0]["pc"]} if tokens else None,
            "last_chunk": {"t": mine[-1]["t"], "pc": mine[-1]["pc"]} if mine else None,
        })
    return out


async def run(args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key="none", max_retries=0,
                         timeout=args.timeout)
    todo: asyncio.Queue = asyncio.Queue()
    for p in plan(args.requests, args.seed, args.eos_token_id):
        todo.put_nowait(p)
    results: list[dict] = []

    async def worker() -> None:
        while True:
            try:
                p = todo.get_nowait()
            except asyncio.QueueEmpty:
                return
            results.append(await one(client, args.model, p))

    started = {"t": time.time(), "pc": time.perf_counter()}
    await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(args.concurrency))),
                           args.deadline)
    await client.close()
    results.sort(key=lambda r: r["index"])
    return {"meta": {"base_url": args.base_url, "model": args.model, "seed": args.seed,
                     "requests": args.requests, "concurrency": args.concurrency,
                     "started": started, "finished": {"t": time.time(),
                                                      "pc": time.perf_counter()}},
            "requests": results}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--eos-token-id", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds for them all")
    args = p.parse_args()
    result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result))
    errors = [r["error"] for r in result["requests"] if r["error"]]
    print(f"{len(result['requests'])} requests, {len(errors)} errors", file=sys.stderr)
    for e in errors[:5]:
        print(e, file=sys.stderr)


if __name__ == "__main__":
    main()
