"""Write the promtool unit tests of the rules (``promtool test rules``) from scenarios.

Each scenario is one model's traffic: a week and an hour of a steady baseline, then
half an hour of a changed regime, as per-minute increments of the counters the
rules read. Writing them out by hand would mean thousands of cumulative values;
here each is a few numbers, and the expected alerts are stated beside them.

A scenario with a ``source`` is an exporter run with ``--source-label``: its series
carry ``source`` (engine, tap or joined) and so must the alerts, one per source that
regressed; the others have no source label, as by default.

The engine-state alerts (``engine-state.test.yml``) need an hour of a sample a
minute, short enough to write by hand; they are generated all the same, so their
expected annotations follow the rules' (whose levers come from the causes' catalog,
exporter/roofline/cause.py): edit a lever, rerun both generators.

    python deploy/prometheus/rule_tests.py          # rewrite tests/*.test.yml
    python deploy/prometheus/rule_tests.py --check  # fail if stale
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TESTS = HERE / "tests"
BASELINE_MINUTES = 7 * 24 * 60 + 60  # a week and an hour: both offsets have data
CHANGED_MINUTES = 30
EVAL = f"{BASELINE_MINUTES + CHANGED_MINUTES}m"
LE = ("0.25", "0.5", "1.0", "2.5", "+Inf")


@dataclass(frozen=True)
class Regime:
    """Per-minute increments: requests, cumulative TTFT buckets (LE order), TTFT sum,
    prefill seconds-per-token sum, queue seconds sum (count = requests for all)."""

    requests: float
    ttft_buckets: tuple[float, ...]
    ttft_sum: float
    prefill_per_token_sum: float
    queue_sum: float


BASE = Regime(60, (50, 58, 60, 60, 60), 12.0, 0.003, 0.6)  # TTFT p95 ~0.47 s, 1 req/s


@dataclass(frozen=True)
class Scenario:
    model: str
    doc: str
    changed: Regime
    base: Regime = BASE
    # (regressed, {quantile: the TTFT promtool must report, as humanizeDuration prints it})
    alerts: tuple[tuple[str, dict[str, str]], ...] = field(default_factory=tuple)
    source: str = ""  # the series' source label (--source-label); "": none

    @property
    def name(self) -> str:
        return f"{self.model} source={self.source}" if self.source else self.model


SLOWER_TTFT = (10, 30, 50, 60, 60)  # p95 ~2.05 s
SCENARIOS = (
    Scenario("prefill-slower", "prefill 3x slower per token: fires, regressed=prefill",
             Regime(60, SLOWER_TTFT, 48.0, 0.009, 0.6),
             alerts=(("prefill", {"p95": "2.05s", "p50": "500ms"}),)),
    Scenario("longer-prompts", "prompts longer, prefill per token and queue unchanged: silent",
             Regime(60, SLOWER_TTFT, 48.0, 0.003, 0.6)),
    Scenario("low-traffic", "the prefill regression at 0.05 req/s: too little to page on",
             Regime(3, tuple(x / 20 for x in SLOWER_TTFT), 2.4, 0.00015, 0.03),
             base=Regime(3, tuple(x / 20 for x in BASE.ttft_buckets), 0.6, 0.00015, 0.03)),
    Scenario("queue-longer", "the queue grew from 10 ms to 0.6 s: fires, regressed=queue",
             Regime(60, SLOWER_TTFT, 48.0, 0.003, 36.0),
             alerts=(("queue", {"p95": "2.05s", "p50": "500ms"}),)),
    # One model seen two ways (--source-label): the client-visible TTFT of the requests
    # the tap and the engine both saw (joined) regresses with the queue; the engine-only
    # requests' TTFT does not. One alert per quantile, naming the joined source.
    Scenario("two-sources", "the queue grew: fires, with source=joined",
             Regime(60, SLOWER_TTFT, 48.0, 0.003, 36.0),
             alerts=(("queue", {"p95": "2.05s", "p50": "500ms"}),), source="joined"),
    Scenario("two-sources", "unchanged: silent", BASE, source="engine"),
)


def _alert_test(series: list[dict], eval_time: str, alertname: str, expected: list) -> dict:
    """One promtool test: 1 m samples, one alert checked at ``eval_time``."""
    return {"interval": "1m", "input_series": series,
            "alert_rule_test": [{"eval_time": eval_time, "alertname": alertname,
                                 "exp_alerts": expected}]}


def _test_file(evaluation_interval: str, *tests: dict) -> dict:
    """A promtool test file over the generated recording and alert rules."""
    return {"rule_files": ["../rules/phasewatch-recording.yml", "../rules/phasewatch-alerts.yml"],
            "evaluation_interval": evaluation_interval, "tests": list(tests)}


def _counter(base: float, changed: float) -> str:
    """promtool's expanding notation for a counter growing by ``base`` a minute, then
    by ``changed`` for CHANGED_MINUTES."""
    last = base * (BASELINE_MINUTES - 1)
    return (f"0+{base:g}x{BASELINE_MINUTES - 1} "
            f"{last + changed:g}+{changed:g}x{CHANGED_MINUTES}")


def _labels(model: str, source: str) -> str:
    return f'model="{model}",engine="vllm"' + (f',source="{source}"' if source else "")


def _series(s: Scenario) -> list[dict]:
    labels = _labels(s.model, s.source)
    out = [{"series": f"phasewatch_requests_total{{{labels},finish_reason=\"stop\"}}",
            "values": _counter(s.base.requests, s.changed.requests)}]
    for le, b, c in zip(LE, s.base.ttft_buckets, s.changed.ttft_buckets, strict=True):
        out.append({"series": f'gen_ai_server_time_to_first_token_seconds_bucket{{{labels},'
                              f'prompt_class="1k-4k",le="{le}"}}', "values": _counter(b, c)})
    out += [
        {"series": f'gen_ai_server_time_to_first_token_seconds_sum{{{labels},'
                   f'prompt_class="1k-4k"}}', "values": _counter(s.base.ttft_sum,
                                                                  s.changed.ttft_sum)},
        {"series": f'gen_ai_server_time_to_first_token_seconds_count{{{labels},'
                   f'prompt_class="1k-4k"}}',
         "values": _counter(s.base.requests, s.changed.requests)},
        {"series": f"phasewatch_prefill_seconds_per_token_sum{{{labels}}}",
         "values": _counter(s.base.prefill_per_token_sum, s.changed.prefill_per_token_sum)},
        {"series": f"phasewatch_prefill_seconds_per_token_count{{{labels}}}",
         "values": _counter(s.base.requests, s.changed.requests)},
        {"series": f'phasewatch_phase_duration_seconds_sum{{{labels},phase="queue"}}',
         "values": _counter(s.base.queue_sum, s.changed.queue_sum)},
        {"series": f'phasewatch_phase_duration_seconds_count{{{labels},phase="queue"}}',
         "values": _counter(s.base.requests, s.changed.requests)},
    ]
    return out


def _annotations(alert: str, labels: dict[str, str], model: str, value: str,
                 source: str = "", **more: str) -> dict[str, str]:
    """The annotation templates of the rule ``alert`` with ``labels``, filled as
    Prometheus fills them: ``value`` as its humanize function prints it, the alert's
    labels (model, engine vllm, source and ``more``), and a ``{{ with $labels.X }}
    ...{{ . }}...{{ end }}`` block only where the alert has the label X."""
    from generate_rules import Params, alerting

    (rule,) = [r for g in alerting(Params())["groups"] for r in g["rules"]
               if r.get("alert") == alert
               and all(r["labels"].get(k) == v for k, v in labels.items())]
    have = {"model": model, "engine": "vllm", "source": source, **more}
    out = {}
    for k, text in rule["annotations"].items():
        text = re.sub(r"\{\{ with \$labels\.(\w+) \}\}(.*?)\{\{ end \}\}",
                      lambda m: m[2].replace("{{ . }}", have[m[1]]) if have.get(m[1]) else "",
                      text)
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: have[m[1]], text)
        out[k] = re.sub(r"\{\{ \$value \| humanize\w* \}\}", value, text)
    return out


def regression_tests() -> dict:
    series = [x for s in SCENARIOS for x in _series(s)]
    expected = [{"exp_labels": {"alertname": "PhasewatchTTFTRegression", "engine": "vllm",
                                "model": s.model, "quantile": q, "regressed": regressed,
                                "severity": "warning", **({"source": s.source} if s.source
                                                          else {})},
                 "exp_annotations": _annotations("PhasewatchTTFTRegression",
                                                 {"regressed": regressed, "quantile": q},
                                                 s.model, value, s.source)}
                for s in SCENARIOS for regressed, values in s.alerts
                for q, value in values.items()]
    # Rules every 5 m over a week of 1 m samples: 2,000 evaluations, not 10,000.
    return _test_file("5m", _alert_test(series, EVAL, "PhasewatchTTFTRegression", expected))


# TTFT SLO burn: per-minute requests and the share of them slower than the SLO
# threshold (1 s, the le="1.0" bucket), for BURN_MINUTES, evaluated at the end.
# With a 99% objective the error budget is 1%: the windows' factors are 14.4 and 6
# (page), 3 and 1 (ticket).
BURN_MINUTES = 120


@dataclass(frozen=True)
class Burn:
    model: str
    doc: str
    error_ratio: float
    # (severity, long window, short window, the long window's ratio as humanizePercentage
    # prints it) of every burn alert that must fire; all others must not.
    alerts: tuple[tuple[str, str, str, str], ...] = ()
    source: str = ""  # the series' source label (--source-label); "": none

    @property
    def name(self) -> str:
        return f"{self.model} source={self.source}" if self.source else self.model


BURNS = (
    Burn("fast-burn", "20% of requests over 1 s for 2 h (20x the budget): both pages and "
         "both tickets fire", 0.20,
         (("page", "1h", "5m", "20%"), ("page", "6h", "30m", "20%"),
          ("ticket", "1d", "2h", "20%"), ("ticket", "3d", "6h", "20%"))),
    Burn("slow-burn", "2% over 1 s (2x the budget): no page, only the 3d/6h ticket", 0.02,
         (("ticket", "3d", "6h", "2%"),)),
    Burn("within-budget", "0.5% over 1 s: nothing fires", 0.005),
    Burn("two-sources", "2% of the client-visible TTFTs over 1 s: only the 3d/6h ticket, "
         "with source=tap", 0.02, (("ticket", "3d", "6h", "2%"),), source="tap"),
    Burn("two-sources", "0.5% of the engine's own TTFTs over 1 s: nothing fires",
         0.005, source="engine"),
)


def burn_tests() -> dict:
    series = []
    for b in BURNS:
        labels = _labels(b.model, b.source) + ',prompt_class="1k-4k"'
        per_minute, fast = 600, 600 * (1 - b.error_ratio)
        series += [
            {"series": f'gen_ai_server_time_to_first_token_seconds_bucket{{{labels},le="1.0"}}',
             "values": f"0+{fast:g}x{BURN_MINUTES}"},
            {"series": f"gen_ai_server_time_to_first_token_seconds_count{{{labels}}}",
             "values": f"0+{per_minute}x{BURN_MINUTES}"},
        ]
    expected = [{"exp_labels": {"alertname": "PhasewatchTTFTSLOBurn", "engine": "vllm",
                                "model": b.model, "severity": severity, "long_window": long,
                                "short_window": short, **({"source": b.source} if b.source
                                                          else {})},
                 "exp_annotations": _annotations("PhasewatchTTFTSLOBurn",
                                                 {"long_window": long}, b.model, value,
                                                 b.source)}
                for b in BURNS for severity, long, short, value in b.alerts]
    return _test_file("1m", _alert_test(series, f"{BURN_MINUTES}m", "PhasewatchTTFTSLOBurn",
                                         expected))


# Latency objectives (--slo): burn alerts from the exact per-request counts. Per minute,
# each (model, objective) has MET met, MISSED missed and UNKNOWN unknown requests, and its
# misses split over phases as ``phases`` says, for BURN_MINUTES; evaluated at the end
# with a 99% target (the error budget 1%, the factors 14.4, 6, 3 and 1).
@dataclass(frozen=True)
class SLOBurn:
    model: str
    objective: str
    doc: str
    met: float
    missed: float
    phases: dict[str, float]  # phase -> share of the misses
    unknown: float = 0
    # (severity, long window, short window) of every burn alert that must fire; all
    # others must not
    fires: tuple[tuple[str, str, str], ...] = ()
    source: str = ""

    @property
    def name(self) -> str:
        who = f"{self.model} source={self.source}" if self.source else self.model
        return f"{who} {self.objective}"


ALL_WINDOWS = (("page", "1h", "5m"), ("page", "6h", "30m"), ("ticket", "1d", "2h"),
               ("ticket", "3d", "6h"))
SLO_BURNS = (
    SLOBurn("slo-ttft", "ttft", "20% of the TTFTs over the objective, 82% of them in the "
            "queue: every window fires, naming the queue", 480, 120,
            {"queue": 0.82, "prefill": 0.18, "preprocess": 0, "kv_transfer": 0,
             "unknown": 0}, fires=ALL_WINDOWS),
    SLOBurn("slo-ttft", "tpot", "the same requests meet their TPOT objective (0.5% missed): "
            "nothing fires", 597, 3, {"decode": 1, "unknown": 0}),
    SLOBurn("slo-tpot", "tpot", "20% of the judged TPOTs missed, all in decode, and as many "
            "unknown as judged (unknown is no miss, nor dilutes one): every window fires, "
            "naming decode", 480, 120, {"decode": 1, "unknown": 0}, unknown=600,
            fires=ALL_WINDOWS),
    SLOBurn("slo-e2el", "e2el", "2% of the e2el objective missed (2x the budget), the "
            "prefill the largest part of 60% of them, on the tap's source: only the 3d/6h "
            "ticket, with source=tap", 588, 12,
            {"prefill": 0.6, "decode": 0.3, "queue": 0.1, "preprocess": 0, "kv_transfer": 0,
             "unknown": 0}, fires=(("ticket", "3d", "6h"),), source="tap"),
)


def _slo_series(b: SLOBurn) -> list[dict]:
    labels = _labels(b.model, b.source) + f',objective="{b.objective}"'
    out = [{"series": f'phasewatch_slo_requests_total{{{labels},outcome="{outcome}"}}',
            "values": f"0+{n:g}x{BURN_MINUTES}"}
           for outcome, n in (("met", b.met), ("missed", b.missed), ("unknown", b.unknown))]
    out += [{"series": f'phasewatch_slo_missed_requests_total{{{labels},phase="{phase}"}}',
             "values": f"0+{b.missed * share:g}x{BURN_MINUTES}"}
            for phase, share in b.phases.items()]
    return out


def _slo_expected(b: SLOBurn, severity: str, long: str, short: str) -> dict:
    """The alert as promtool must see it, its annotations written out in full."""
    from generate_rules import Params

    factor = {(lw, sw): f for _, lw, sw, f in Params().burn_windows}[(long, short)]
    ratio = b.missed / (b.met + b.missed)
    phase, share = max(b.phases.items(), key=lambda kv: kv[1])
    source = f" ({b.source})" if b.source else ""
    source_in = f", source {b.source}" if b.source else ""
    return {
        "exp_labels": {"alertname": "PhasewatchSLOBurn", "model": b.model, "engine": "vllm",
                       "objective": b.objective, "severity": severity, "long_window": long,
                       "short_window": short, **({"source": b.source} if b.source else {})},
        "exp_annotations": {
            "summary": (f"{b.objective.upper()} objective of {b.model}{source} burning "
                        f"{factor}x its error budget"),
            "description": (
                f"{ratio:.0%} of the requests of {b.model} (vllm{source_in}) missed their "
                f"{b.objective.upper()} objective over {long} (and {short}): {factor}x the "
                f"error budget of a 99.00% target. {share:.0%} of the {b.objective.upper()} "
                "misses over "
                f"the last {long} spent most of their time in the {phase} phase.")}}


def slo_burn_tests() -> dict:
    series = [x for b in SLO_BURNS for x in _slo_series(b)]
    expected = [_slo_expected(b, *w) for b in SLO_BURNS for w in b.fires]
    # No --slo: the exporter publishes no phasewatch_slo_* series, so nothing to burn.
    plain = [{"series": f'phasewatch_requests_total{{{_labels("no-objectives", "")},'
                        'finish_reason="stop"}', "values": f"0+600x{BURN_MINUTES}"}]
    return _test_file("1m", _alert_test(series, f"{BURN_MINUTES}m", "PhasewatchSLOBurn",
                                         expected),
                      _alert_test(plain, f"{BURN_MINUTES}m", "PhasewatchSLOBurn", []))


# The engine's own state (phasewatch_engine_*, from its /metrics scrape) and the
# roofline's ceilings: a sample a minute for ENGINE_MINUTES, rules evaluated every
# minute. Each case is one engine's series; its alert must fire at the eval times
# it names (with the value as promtool's humanize prints it) and at no other.
ENGINE_MINUTES = 60


@dataclass(frozen=True)
class EngineCase:
    model: str
    doc: str
    alert: str
    series: str  # the family and its labels past model/engine: 'x{phase="prefill"}'
    values: str  # promtool's expanding notation, a sample a minute
    fires: dict[str, str] = field(default_factory=dict)  # eval time -> $value printed
    pod: str = ""  # the pod label (a Kubernetes target's); "": none
    sources: tuple[str, ...] = ("",)  # one series per source (--source-label)

    @property
    def name(self) -> str:
        return f"{self.alert} {self.model}"

    def labels(self) -> dict[str, str]:
        """The alert's labels past alertname and severity: all the series' but source."""
        extra = dict(re.findall(r'(\w+)="([^"]*)"', self.series))
        return {"model": self.model, "engine": "vllm", **({"pod": self.pod} if self.pod
                                                          else {}), **extra}


KV = "phasewatch_engine_kv_cache_usage_ratio"
PREEMPTIONS = "phasewatch_engine_preemptions_total"
CEILING = 'phasewatch_roofline_ceiling_exceeded_ratio{phase="prefill",ceiling="flops"}'
ENGINE_EVALS = ("4m", "12m", "30m", "60m")
FIRING = ENGINE_EVALS[1:]  # all but the first, where every case is at most pending
ENGINE_CASES = (
    EngineCase("kv-full", "97% used all along: pending at 4m, firing from 5m",
               "PhasewatchEngineKVCacheFull", KV, f"0.97x{ENGINE_MINUTES}",
               dict.fromkeys(FIRING, "97%"), pod="llm-0"),
    EngineCase("kv-high", "90% used all along: under 95%, silent",
               "PhasewatchEngineKVCacheFull", KV, f"0.9x{ENGINE_MINUTES}"),
    EngineCase("kv-dips", "full, but down to 90% every 4 minutes: never full for 5m, silent",
               "PhasewatchEngineKVCacheFull", KV, " ".join(["1 1 1 0.9"] * 16)),
    EngineCase("kv-sources", "full, the one engine under two sources: one alert, no source",
               "PhasewatchEngineKVCacheFull", KV, f"0.99x{ENGINE_MINUTES}",
               dict.fromkeys(FIRING, "99%"), pod="llm-1", sources=("engine", "joined")),
    EngineCase("preempting", "2 preemptions a minute all along: firing from 11m",
               "PhasewatchEnginePreempting", PREEMPTIONS, f"0+2x{ENGINE_MINUTES}",
               dict.fromkeys(FIRING, "10"), pod="llm-0"),
    EngineCase("burst", "40 preemptions over 4 minutes from 6m, none since: silent (for 5m "
               "would fire at 11m)", "PhasewatchEnginePreempting", PREEMPTIONS,
               f"0x5 10 20 30 40x{ENGINE_MINUTES - 9}"),
    EngineCase("restarted", "500 before the engine restarted at 21m (a counter reset), none "
               "since: silent", "PhasewatchEnginePreempting", PREEMPTIONS,
               f"500x20 0x{ENGINE_MINUTES - 21}"),
    EngineCase("restarted-preempting", "2 preemptions a minute, and the engine restarted at "
               "21m (the counter back to 0): firing from 11m on, through the reset (a delta() "
               "would go negative and restart the 10m)", "PhasewatchEnginePreempting",
               PREEMPTIONS, f"0+2x20 0+2x{ENGINE_MINUTES - 21}", dict.fromkeys(FIRING, "10")),
    EngineCase("preempting-sources", "a preemption a minute, the one engine under two "
               "sources: one alert, no source", "PhasewatchEnginePreempting", PREEMPTIONS,
               f"0+1x{ENGINE_MINUTES}", dict.fromkeys(FIRING, "5"), sources=("engine", "tap")),
    EngineCase("ceiling-wrong", "prefill at 1.84x the FLOP/s ceiling all along: firing "
               "from 10m", "PhasewatchRooflineCeilingExceeded", CEILING,
               f"1.84x{ENGINE_MINUTES}", dict.fromkeys(FIRING, "1.84"), pod="llm-0"),
    EngineCase("ceiling-blip", "over the ceiling for 5 minutes, then not published: silent",
               "PhasewatchRooflineCeilingExceeded", CEILING, "1.3x4 stale"),
)


def engine_tests() -> dict:
    from generate_rules import Params, alerting

    severity = {r["alert"]: r["labels"]["severity"] for g in alerting(Params())["groups"]
                for r in g["rules"] if "alert" in r}
    series = []
    for c in ENGINE_CASES:
        name, _, rest = c.series.partition("{")
        for source in c.sources:
            labels = ",".join(filter(None, (
                _labels(c.model, source), f'pod="{c.pod}"' if c.pod else "", rest[:-1])))
            series.append({"series": f"{name}{{{labels}}}", "values": c.values})
    tests = []
    for alert in dict.fromkeys(c.alert for c in ENGINE_CASES):
        for at in ENGINE_EVALS:
            tests.append({"eval_time": at, "alertname": alert, "exp_alerts": [
                {"exp_labels": {"alertname": alert, "severity": severity[alert],
                                **c.labels()},
                 "exp_annotations": _annotations(alert, {}, c.model, c.fires[at],
                                                 **{k: v for k, v in c.labels().items()
                                                    if k not in ("model", "engine")})}
                for c in ENGINE_CASES if c.alert == alert and at in c.fires]})
    return {
        "rule_files": ["../rules/phasewatch-alerts.yml"],
        "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": tests}],
    }


def _dump(scenarios, doc: dict) -> str:
    head = ("# Generated by deploy/prometheus/rule_tests.py from its scenarios:\n" +
            "".join(f"#   {s.name}: {s.doc}\n" for s in scenarios))
    return head + yaml.safe_dump(doc, sort_keys=False, width=100)


def render() -> dict[str, str]:
    return {"ttft-regression.test.yml": _dump(SCENARIOS, regression_tests()),
            "ttft-slo-burn.test.yml": _dump(BURNS, burn_tests()),
            "slo-burn.test.yml": _dump(SLO_BURNS, slo_burn_tests()),
            "engine-state.test.yml": _dump(ENGINE_CASES, engine_tests())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args(argv)
    TESTS.mkdir(exist_ok=True)
    for name, text in render().items():
        path = TESTS / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                print(f"stale: {path}; run python deploy/prometheus/rule_tests.py")
                return 1
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
