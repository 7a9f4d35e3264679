"""Colours, units and the words behind the jargon: one place for the whole page.

Phase colours are the Okabe-Ito colour-blind-safe palette, the same in every
figure, the banner and the cards: preprocess sky blue, queue orange, prefill blue,
KV transfer yellow, decode green.
"""

from __future__ import annotations

PHASE_COLORS = {"preprocess": "#56B4E9", "queue": "#E69F00", "prefill": "#0072B2",
                "kv_transfer": "#F0E442", "ttft": "#999933", "decode": "#009E73"}
# In the order a request passes them. preprocess is known only where the server says
# when its engine took the request in (vLLM, TGI, SGLang); elsewhere it is inside the
# queue. kv_transfer exists only for disaggregated prefill/decode (SGLang). ttft stands
# for preprocess, queue and prefill together in the client's view (a stream tap's
# records, no engine spans), which has nothing finer.
PHASES = ("preprocess", "queue", "prefill", "kv_transfer", "ttft", "decode")
OPTIONAL_PHASES = ("preprocess", "kv_transfer", "ttft")  # absent = 0 in a request's bar
REQUIRED_PHASES = ("queue", "prefill", "decode")
CLIENT_PHASES = ("ttft", "decode")  # the client's view: all it can split
# The banner takes the colour of the bottleneck; overhead and unknown get their own.
RESOURCE_COLORS = {"capacity": PHASE_COLORS["queue"], "frontend": PHASE_COLORS["preprocess"],
                   "interconnect": PHASE_COLORS["kv_transfer"], "overhead": "#CC79A7",
                   "unknown": "#7F7F7F"}
NEUTRAL = "#7F7F7F"
DARK = "#1a1a1a"  # banner text where white would not stand out
ERROR = "#D55E00"
CEILING_STYLES = {"datasheet": {"color": "#444444", "dash": "solid"},
                  "achievable": {"color": "#888888", "dash": "dash"},
                  "measured": {"color": "#CC79A7", "dash": "dash"}}


def verdict_color(phase: str | None, resource: str | None) -> str:
    if resource in RESOURCE_COLORS:
        return RESOURCE_COLORS[resource]
    return PHASE_COLORS.get(phase or "", NEUTRAL)


def _luminance(hex_color: str) -> float:
    """WCAG 2 relative luminance of ``#RRGGBB``."""
    def channel(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4

    r, g, b = (channel(int(hex_color[i:i + 2], 16) / 255) for i in (1, 3, 5))
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def text_color(phase: str | None, resource: str | None) -> str:
    """White or near-black, whichever contrasts more with the banner's colour (white on
    the queue's orange or KV transfer's yellow is hard to read; WCAG 2 contrast ratio)."""
    bg = _luminance(verdict_color(phase, resource))
    return "#fff" if (1.05 / (bg + 0.05)) >= ((bg + 0.05) / (_luminance(DARK) + 0.05)) else DARK


# Tooltips for every term a newcomer may not know (shown on hover, dotted underline).
GLOSSARY = {
    "TTFT": "Time to first token: from the request's arrival to its first output token "
            "(preprocess + queue + prefill).",
    "ttft": "Time to first token as one phase: preprocess, queue and prefill undivided, "
            "as the client sees them (a stream tap's records carry no engine times; give "
            "the engine's spans to split it).",
    "ITL": "Inter-token latency: every gap between consecutive emissions (streamed chunks; "
           "a chunk may carry several tokens), pooled over requests, as vLLM's benchmark "
           "itl and aiperf's inter-chunk latency; stalls show in its tail. aiperf's and "
           "guidellm's \"ITL\" is what phasewatch calls TPOT.",
    "TPOT": "Time per output token: one request's decode time / (output tokens - 1), as "
            "vLLM's benchmark TPOT (aiperf and guidellm call it ITL; guidellm's \"TPOT\" "
            "divides the whole request time, TTFT included, by the output tokens).",
    "e2e": "End-to-end latency: arrival to the request's finish (its response ended). "
           "vLLM's e2e ends at the last token, guidellm's at the stream's end; the JSON "
           "API gives both where the server reports both (e2e_to_last_token_seconds).",
    "sampled": "Traces kept by a sampler upstream (the OpenTelemetry tracestate's ot=th, or "
               "--trace-sample-ratio): requests and tokens are counted as the requests "
               "they stand for (1 / the probability each was kept with); latency "
               "percentiles are of the requests received.",
    "goodput": "Requests per second that met every latency objective set (--slo), as "
               "vllm bench serve --goodput and DistServe define it; each request is judged "
               "exactly, not from histogram buckets.",
    "GPU counters": "The GPU's own activity counters (a dcgm-exporter's page or NVML), mean "
                    "over the estimate's range: DRAM active is the share of cycles the memory "
                    "interface was busy, tensor the share any tensor pipe was. The estimate "
                    "beside them is the least the work needs, so it should read at or below "
                    "them.",
    "MBU": "Model bandwidth utilization: bytes decode moved per second over the GPUs' "
           "datasheet peak memory bandwidth.",
    "MFU": "Model FLOPs utilization: FLOP/s prefill performed over the GPUs' datasheet dense "
           "peak.",
    "decode batch": "Mean number of requests decoding together in one step: the engine's "
                    "own steps where it reports them (TGI), else estimated from "
                    "overlapping decode intervals.",
    "arithmetic intensity": "FLOPs performed per byte moved from memory. Left of the ridge "
                            "a phase is bandwidth-bound, right of it compute-bound.",
    "preprocess": "Before the engine's queue: templating, tokenisation and the hand-off "
                  "from the API server to the engine (and, for vLLM, the first output's "
                  "trip back): arrival to queued. CPU work, not GPU.",
    "queue": "Waiting in the engine's queue for the scheduler: queued to scheduled (from "
             "arrival when the server does not say when it queued the request).",
    "prefill": "Reading the prompt in one parallel pass: scheduled to first token "
               "(compute-bound).",
    "kv_transfer": "Disaggregated prefill/decode only: the KV cache the prefill server "
                   "filled, sent to the decode server (SGLang's prefill_transfer_kv_cache), "
                   "between prefill and the first token. Network-bound.",
    "decode": "Emitting tokens one step at a time: first to last token "
              "(memory-bandwidth-bound).",
    "confidence": "How sure the verdict is: sample size, margins between phases and "
                  "ceilings, and the quality of the inputs.",
}

# One line under each graph saying how to read it.
CAPTIONS = {
    "roofline": "Each phase sits at its arithmetic intensity (FLOPs per byte moved). Left "
                "of a ceiling's bend (the ridge) the sloped bandwidth line limits it, right "
                "of it the flat compute line; the gap to the line is headroom.",
    "prompt-ttft": "Dots are requests, lines the p50/p95 of each prompt-length class. TTFT "
                   "rising along the line is longer prompts; the line itself rising is a "
                   "slower prefill or a longer queue.",
    "ttft-series": "TTFT runs from the request's arrival to its first token: every phase "
                   "before decode. Percentiles over the rolling window.",
    "token-latency": "ITL pools every gap between tokens (stalls show in p95); TPOT is each "
                     "request's mean decode time per token.",
    "throughput": "Prompt tokens read by prefill and output tokens written by decode, per "
                  "second.",
    "shares": "Where request time goes: the API server's work (preprocess), waiting "
              "(queue), reading the prompt (prefill), writing tokens (decode).",
    "slo": "The share of requests that met each objective (--slo) over the rolling "
           "window, and the share that met every one of them (goodput's requests).",
    "replicas": "Each pod of a model that two or more serve, from its own series over the "
                "range: requests per second, TTFT percentiles, the share of its request time "
                "in the engine's queue, its engine's KV-cache usage (where the exporter "
                "scrapes the engine) and its verdict.",
    "waterfall": "Each bar is one request on a shared clock, split into the phases the "
                 "title names, in the order the request passed them.",
}

PAGE_CSS = """
body { font-family: -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif;
       margin: 0; background: #f5f6f8; color: #222; }
.pw-header { display: flex; align-items: center; gap: 16px; padding: 10px 20px;
             background: #1f2430; color: #fff; flex-wrap: wrap; }
.pw-header h1 { font-size: 18px; margin: 0 12px 0 0; }
.pw-source { font-size: 12px; opacity: 0.8; }
.pw-selectors { display: flex; gap: 8px; flex-wrap: wrap; align-items: center; }
.pw-selectors .pw-select { min-width: 180px; color: #222; }
.pw-main { padding: 12px 20px; }
.pw-state { padding: 14px 18px; border-radius: 6px; margin-bottom: 12px;
            border-left: 8px solid #7F7F7F; background: #fff; }
/* the verdict area holds its banners' margins (PAGE_SCRIPT sets its height) */
#state { display: flow-root; }
.pw-note { padding: 8px 14px; border-radius: 6px; margin-bottom: 10px; font-size: 14px;
           background: #fff; border-left: 8px solid #56B4E9; }
.pw-state.error { border-left-color: #D55E00; background: #fdf1ea; }
.pw-banner { padding: 12px 18px; border-radius: 6px; margin-bottom: 10px; color: #fff; }
.pw-banner h2 { margin: 0 0 4px 0; font-size: 22px; }
.pw-banner p { margin: 4px 0; }
.pw-banner .pw-cause { font-size: 16px; }
.pw-cause-source { font-size: 13px; opacity: 0.85; white-space: nowrap; }
.pw-chips { display: flex; gap: 8px; flex-wrap: wrap; margin-top: 6px; }
.pw-chip { background: rgba(255,255,255,0.2); border-radius: 12px; padding: 2px 10px;
           font-size: 13px; }
.pw-levers { font-size: 14px; margin-top: 6px; }
.pw-levers ul { margin: 2px 0 0; padding-left: 20px; columns: 2 420px; column-gap: 28px; }
.pw-levers li { break-inside: avoid; }
.pw-flag { white-space: nowrap; font-size: 13px; background: rgba(255,255,255,0.25);
           border-radius: 3px; padding: 0 1px; }
.pw-cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr));
            gap: 8px; margin-bottom: 12px; }
.pw-card { background: #fff; border-radius: 6px; padding: 8px 12px;
           box-shadow: 0 1px 2px rgba(0,0,0,0.08); }
.pw-card .pw-card-title { font-size: 12px; color: #555; }
.pw-card .pw-card-value { font-size: 20px; font-weight: 600; }
.pw-card .pw-card-sub { font-size: 11px; color: #777; }
.pw-bench { background: #fff; border-radius: 6px; padding: 8px 12px; margin-bottom: 12px; }
.pw-bench summary { cursor: pointer; font-size: 13px; color: #333; }
.pw-bench-blocks { display: flex; flex-wrap: wrap; gap: 12px; }
.pw-bench pre { font-size: 12px; margin: 8px 0 0; }
.pw-term { text-decoration: underline dotted; cursor: help; }
/* Six panels in 1, 2 or 3 columns (six fills each) and the waterfall on a row of its
   own: no width leaves a hole. auto-fill put seven panels in rows of two at 1280 px
   (the last one alone: one hole) and of three at 1920 px (two holes). */
.pw-grid { display: grid; grid-template-columns: minmax(0, 1fr); gap: 10px; }
@media (min-width: 1100px) { .pw-grid { grid-template-columns: repeat(2, minmax(0, 1fr)); } }
@media (min-width: 1700px) { .pw-grid { grid-template-columns: repeat(3, minmax(0, 1fr)); } }
.pw-panel.pw-full-row { grid-column: 1 / -1; }
/* The objectives' attainment over time: across the page, under their cards (outside
   the grid, so the grid's tiling is the same with and without objectives). */
.pw-slo-panel { background: #fff; border-radius: 6px; padding: 6px; margin-bottom: 12px;
                box-shadow: 0 1px 2px rgba(0,0,0,0.08); }
/* The replicas of a fleet side by side: outside the grid too, one table per model. */
.pw-replicas { background: #fff; border-radius: 6px; padding: 8px 12px; margin-bottom: 12px;
               box-shadow: 0 1px 2px rgba(0,0,0,0.08); }
.pw-replica-set h3 { font-size: 15px; margin: 4px 0 6px; }
.pw-replica-set h3 span { font-weight: normal; color: #555; }
.pw-replica-table { border-collapse: collapse; width: 100%; font-size: 13px; }
.pw-replica-table th { text-align: left; font-weight: 600; color: #555; padding: 4px 8px;
                       border-bottom: 1px solid #ddd; white-space: nowrap; }
.pw-replica-table td { padding: 4px 8px; border-bottom: 1px solid #eee;
                       font-variant-numeric: tabular-nums; }
.pw-replica-table td:nth-child(n+2):nth-child(-n+6),
.pw-replica-table th:nth-child(n+2):nth-child(-n+6) { text-align: right; white-space: nowrap; }
.pw-replica-table td.pw-pod { white-space: nowrap; font-family: monospace; }
.pw-replica-table tr.pw-outlier { background: #fdf1ea; }
.pw-replica-table tr.pw-outlier td:first-child { box-shadow: inset 4px 0 0 #D55E00; }
.pw-replica-table td.pw-flagged { color: #A33F00; font-weight: 700; }
.pw-replica-table tr.pw-outlier td { border-bottom: none; }
.pw-replica-table tr.pw-why { background: #fdf1ea; }
.pw-replica-table tr.pw-why td { box-shadow: inset 4px 0 0 #D55E00; padding: 0 8px 6px 28px; }
.pw-replica-table tr.pw-why ul { margin: 0; padding-left: 14px; color: #5a2a00; }
.pw-panel { background: #fff; border-radius: 6px; padding: 6px;
            box-shadow: 0 1px 2px rgba(0,0,0,0.08); }
.pw-caption { font-size: 12px; color: #555; margin: 2px 8px 4px; }
.pw-footer { font-size: 12px; color: #666; padding: 6px 20px 16px; }
"""

# The verdict area (#state) keeps the tallest height it has had while the same verdicts
# show at the same width, within SLACK_PX of what it needs: its prose rewraps by a line
# as its figures change on every refresh, and the whole grid under it jumped 19 px up
# and down about once a second at 1280 px. A new verdict (another model, phase or
# cause), another width, or a verdict that needs much less room (its predictions gone)
# lets it fit again. The height is read with the hold let go and set again in one
# script, so no frame shows it let go; it is set on the container, which Dash never
# re-creates.
SLACK_PX = 48  # two lines of the banner's prose
PAGE_SCRIPT = """
(function () {
  function key(el) {
    return window.innerWidth + '|' + Array.from(el.querySelectorAll('.verdict'))
      .map(function (v) { return [v.dataset.model, v.dataset.phase, v.dataset.cause].join('/'); })
      .join(',');
  }
  function hold() {
    var el = document.getElementById('state');
    if (!el) { return; }
    var k = key(el), held = parseFloat(el.style.minHeight) || 0;
    el.style.minHeight = '';
    var needs = el.getBoundingClientRect().height;
    if (el.dataset.pwHeld !== k || held - needs > SLACK) { held = 0; }
    el.dataset.pwHeld = k;
    el.style.minHeight = Math.max(held, needs) + 'px';
  }
  new MutationObserver(hold).observe(document.documentElement,
    {childList: true, subtree: true, characterData: true});
  window.addEventListener('resize', hold);
})();
""".replace("SLACK", str(SLACK_PX))
