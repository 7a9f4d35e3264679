"""A steady workload against an OpenAI-compatible server: N streams, each sending one
streamed completion after another for a fixed time, every request with the same prompt
length and output length. What a load generator (``vllm bench serve`` with a fixed
concurrency) does, small enough to run beside a CPU vLLM.

Runs with the engine virtualenv's Python (it has the ``openai`` client)::

    .venv-vllm/bin/python tests/engines/steady_load.py --base-url http://127.0.0.1:8000/v1 \
        --model tiny-llama --streams 12 --prompt-words 400 --max-tokens 200 \
        --seconds 30 --out load.json

Every prompt starts with a number unique to it, so the prefix cache serves at most the
words after the first few (prompts are otherwise the same text): prefill really runs.
Output length is fixed with ``min_tokens`` = ``max_tokens`` and ``ignore_eos`` (vLLM's
sampling parameters), so each request decodes exactly ``--max-tokens`` tokens. With
``--mix`` a second group of streams sends long prompts with short outputs beside the
first (prefill chunks sharing decode steps); with ``--mix-on`` / ``--mix-off`` that group
sends only in the first ``--mix-on`` seconds of every ``--mix-on`` + ``--mix-off`` from the
start (bursts of prefills, and stretches without any).

The output: per group, requests started, finished and failed (with the first errors),
output tokens received, the gaps between a finished request's successive text chunks
(``gaps``: [wall-clock time of the later chunk, seconds], the client's inter-token
latency as ``vllm bench serve`` reads it: vLLM streams a token a chunk), and the
wall-clock start and end of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

_SENTENCE = ("the queue was long and the prefill took most of the time while decode kept the "
             "memory bandwidth busy on every step of the batch so the sidecar measured each "
             "phase of every request and reported it")
_TEXT = _SENTENCE.split()


def prompt(words: int, serial: int) -> str:
    body = " ".join(_TEXT[k % len(_TEXT)] for k in range(max(words - 1, 0)))
    return f"{serial} {body}"


async def stream_loop(client, model: str, group: dict, deadline: float, counter: list,
                      stats: dict) -> None:
    failures = 0
    while time.time() < deadline and failures < 3:  # a refusing server ends the stream
        if group.get("off"):  # bursts: wait out the stretch without
            into = (time.time() - stats["begun"]) % (group["on"] + group["off"])
            if into >= group["on"]:
                await asyncio.sleep(group["on"] + group["off"] - into)
                continue
        counter[0] += 1
        stats["started"] += 1
        try:
            response = await client.completions.create(
                model=model, prompt=prompt(group["prompt_words"], counter[0]),
                max_tokens=group["max_tokens"], temperature=0.0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"min_tokens": group["max_tokens"], "ignore_eos": True})
            gaps, last = [], None
            async for chunk in response:
                if chunk.choices and chunk.choices[0].text:
                    now = time.time()
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
                if chunk.usage is not None:
                    stats["output_tokens"] += chunk.usage.completion_tokens
                    stats["prompt_tokens"] += chunk.usage.prompt_tokens
            stats["finished"] += 1
            stats["gaps"] += gaps  # a finished request's only
            failures = 0
            if group.get("think"):  # a client's own time between an answer and its next
                await asyncio.sleep(group["think"])
        except Exception as e:  # the run goes on; the caller judges the failures
            failures += 1
            stats["failed"] += 1
            if len(stats["errors"]) < 5:
                stats["errors"].append(f"{type(e).__name__}: {e}"[:300])


def group_stats(group: dict, begun: float) -> dict:
    """A group's counts as its streams fill them (``stream_loop``), from ``begun``."""
    return {**group, "begun": begun, "started": 0, "finished": 0, "failed": 0,
            "output_tokens": 0, "prompt_tokens": 0, "errors": [], "gaps": []}


async def run(args) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=args.base_url, api_key="unused", timeout=args.timeout,
                         max_retries=0)
    groups = [{"name": "main", "streams": args.streams, "prompt_words": args.prompt_words,
               "max_tokens": args.max_tokens, "think": args.think}]
    if args.mix_streams:
        groups.append({"name": "mix", "streams": args.mix_streams,
                       "prompt_words": args.mix_prompt_words,
                       "max_tokens": args.mix_max_tokens, "think": args.mix_think,
                       "on": args.mix_on, "off": args.mix_off})
    start = time.time()
    deadline = start + args.seconds
    counter = [args.serial_base]
    tasks, stats = [], {}
    for g in groups:
        s = stats[g["name"]] = group_stats(g, start)
        tasks += [stream_loop(client, args.model, g, deadline, counter, s)
                  for _ in range(g["streams"])]
    await asyncio.gather(*tasks)
    await client.close()
    return {"start": start, "end": time.time(), "groups": stats}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="http://HOST:PORT/v1")
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--mix-streams", type=int, default=0)
    p.add_argument("--mix-prompt-words", type=int, default=500)
    p.add_argument("--mix-max-tokens", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--think", type=float, default=0.0,
                   help="seconds each main stream waits after an answer before it sends again")
    p.add_argument("--mix-think", type=float, default=0.0,
                   help="seconds each mix stream waits after an answer before it sends again")
    p.add_argument("--mix-on", type=float, default=0.0,
                   help="with --mix-off: seconds the mix streams send, from the start")
    p.add_argument("--mix-off", type=float, default=0.0,
                   help="seconds the mix streams then wait, in turn with --mix-on")
    p.add_argument("--serial-base", type=int, default=0,
                   help="first prompt serial (distinct runs: distinct prompts)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    args.out.write_text(json.dumps(result, indent=1))
    failed = sum(g["failed"] for g in result["groups"].values())
    print(json.dumps({k: {x: g[x] for x in ("started", "finished", "failed")}
                      for k, g in result["groups"].items()}), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
