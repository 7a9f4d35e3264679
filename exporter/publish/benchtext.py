"""phasewatch's figures laid out as ``vllm bench serve`` prints its result.

So a user can set a benchmark run and what phasewatch saw in production side by side:
the same rows, names, units (ms) and layout as vLLM's benchmark (a 50-column block,
labels left-aligned in 40 columns, values with two decimals), with its
``--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99`` choice:
Mean, Median and P50/P90/P99 per metric. The definitions behind the numbers are the
same (phasewatch's TTFT, TPOT, pooled ITL and e2e are vLLM's benchmark's, docs/metrics.md
"Phases and metrics"); what differs is the population: requests that finished in the
chosen range, as the server saw them.

``figures`` is one label set's: ``requests``, ``duration_s``, ``prompt_tokens``,
``output_tokens`` and, for ``ttft``, ``tpot``, ``itl``, ``e2e``, a dict of seconds with
``mean``, ``p50``, ``p90``, ``p99`` (None = unknown, printed as ``-``); with latency
objectives (``--slo``) also ``good_requests``, printed as vLLM prints ``--goodput``'s
result: "Request goodput (req/s):", good requests over the duration, after the request
throughput (the line is absent without objectives, as in vLLM without ``--goodput``).
"""

from __future__ import annotations

import math

WIDTH = 50
METRICS = (("ttft", "TTFT", "Time to First Token"),
           ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
           ("itl", "ITL", "Inter-token Latency"),
           ("e2e", "E2EL", "End-to-end Latency"))
PERCENTILES = ("p50", "p90", "p99")


def _value(v, ms: bool = False, integer: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    if integer:
        return f"{round(v):<10}"
    return f"{v * 1000 if ms else v:<10.2f}"


def _line(label: str, value: str) -> str:
    return f"{label:<40} {value}".rstrip()


def render(title: str, figures: dict) -> str:
    """One label set as ``vllm bench serve`` prints a run (title: whose figures)."""
    duration = figures.get("duration_s")
    n, prompt, output = (figures.get(k) for k in ("requests", "prompt_tokens",
                                                    "output_tokens"))

    def per_s(x):
        return x / duration if x is not None and duration else None

    total = prompt + output if prompt is not None and output is not None else None
    lines = [f"{' Serving Benchmark Result ':=^{WIDTH}}", _line("Source:", title),
             _line("Successful requests:", _value(n, integer=True)),
             _line("Benchmark duration (s):", _value(duration)),
             _line("Total input tokens:", _value(prompt, integer=True)),
             _line("Total generated tokens:", _value(output, integer=True)),
             _line("Request throughput (req/s):", _value(per_s(n))),
             *([_line("Request goodput (req/s):", _value(per_s(figures["good_requests"])))]
               if figures.get("good_requests") is not None else []),
             _line("Output token throughput (tok/s):", _value(per_s(output))),
             _line("Total Token throughput (tok/s):", _value(per_s(total)))]
    for key, short, heading in METRICS:
        stats = figures.get(key) or {}
        lines.append(f"{heading:-^{WIDTH}}")
        lines.append(_line(f"Mean {short} (ms):", _value(stats.get("mean"), ms=True)))
        lines.append(_line(f"Median {short} (ms):", _value(stats.get("p50"), ms=True)))
        for p in PERCENTILES:
            lines.append(_line(f"P{p[1:]} {short} (ms):", _value(stats.get(p), ms=True)))
    lines.append("=" * WIDTH)
    return "\n".join(lines)
