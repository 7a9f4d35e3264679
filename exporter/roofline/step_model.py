"""The engine's step time fitted online from the window's records, for the levers'
predicted effects (``levers``).

The form is the one the step models that held up against real engines use (Dynamo's
planner, the fitted linear models Vidur's checks compared): a step lasts

    step = base + per_prefill_token x (prefill tokens in it) + per_kv_token x (KV
    tokens its decodes read)

``base`` is the step's fixed cost (the weights read once, the scheduler and the
launches), ``per_kv_token`` the cost of one context token's KV cache read by a decode,
``per_prefill_token`` one prompt token's prefill.

No record holds a step. Each decoding request holds a mean of its own steps: its decode
time over its steps, at the mean of what the steps it ran in carried. So each is one
row: its mean step against (the prefill tokens the window's prefills ran while it
decoded, spread evenly over each prefill's interval, per step of its own; the context
tokens of every request decoding beside it, its own included, each at its prompt plus
half its output: the KV cache a step reads), weighted by its steps. A weighted least
squares line through the rows gives the three costs.

The roofline is the prior. A cost whose input barely varies in the window (every decode
ran beside the same batch, no prefill ran beside any) cannot be fitted: it is held at
the roofline's (the KV token at the achievable bandwidth, the prompt token's FLOPs at
the achievable FLOP/s) and the others fitted around it. So is one of two inputs that
moved together: at a slot limit a request prefilling holds a slot no decode has, so the
prefill tokens beside each decode fall as its batch rises (-0.96 to -0.99 on the real
vLLM's slot-limit windows), and the free fit's split of their cost swung from run to
run (a KV token at 0.7 us, at 440 us and at 540 us; at 16 slots, where both rise, the
step predicted 44 % and 53 % long). What tells a slope is its input's variation apart
from the other's: its spread times sqrt(1 - r^2), r their correlation (the least-squares
slope's standard error grows as that shrinks). The input whose variation apart is under
``APART`` of its mean, or under ``NOISE`` times the free fit's median error (a scatter
about the line that large hides a slope over so little variation), is held at the
roofline's, the other fitted. A fitted cost under the
roofline's is not believed either: held at the floor, and the fit says so. A base under
the weights' read at the achievable bandwidth means the window cannot separate the
fixed cost from the rest: the fit is rejected and says why; no lever is predicted from
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.aggregation.columns import WindowColumns
from phasewatch.roofline import model_costs
from phasewatch.roofline.estimate import Deployment
from phasewatch.roofline.intervals import Overlaps, decodes, evenly_spaced

MIN_REQUESTS = 8  # decoding requests the fit needs
SPREAD = 0.15  # an input's 10th-90th percentile range under this x its mean: not fitted
# An input whose variation apart from the other's (its spread x sqrt(1 - r^2)) is under
# the larger of these (APART of its mean, NOISE x the free fit's median error) is held:
# the window tells the inputs' summed cost, not each one's (``_held_fit``). The real
# vLLM's slot-limit windows read 0.03-0.08 apart where the free fit's KV token swung
# (0.7 to 1,230 us); its full-size window, 0.13 with a 2.2 % error, fitted both.
APART = 0.10
NOISE = 2.0
FLOOR_SLACK = 0.9  # a fitted cost this far under the roofline's is held at it


def computed_prompt(cols: WindowColumns) -> np.ndarray:
    """The prompt tokens each request's prefill computed: the uncached ones, the whole
    prompt where the prefix cache is not known."""
    return cols.memo("computed_prompt", lambda: np.where(
        cols.uncached >= 0, cols.uncached, cols.prompt).astype(float))


def prefilled(cols: WindowColumns) -> tuple[np.ndarray, np.ndarray]:
    """(``computed_prompt``, the requests whose prefill is timed and computed tokens:
    scheduled before their first token), made once for the columns."""
    def make() -> tuple[np.ndarray, np.ndarray]:
        sched, first, computed = cols.scheduled_at, cols.first_token_at, computed_prompt(cols)
        return computed, ~np.isnan(sched) & ~np.isnan(first) & (first > sched) & (computed > 0)
    return cols.memo("prefilled", make)


@dataclass(frozen=True)
class StepRows:
    """The decoding requests the fit reads, one row each: mean step, the prefill tokens
    per step beside it, the KV tokens a step read, the batch, the steps (its weight)."""

    step: np.ndarray
    prefill: np.ndarray
    kv: np.ndarray
    batch: np.ndarray
    steps: np.ndarray
    context: float  # the mean context (KV tokens) of one decoding sequence

    @staticmethod
    def decoding(cols: WindowColumns, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """(the requests that decoded, those of them whose decode lay wholly in [lo, hi]:
        the rows)."""
        first, last = cols.first_token_at, cols.last_token_at
        dec = ~np.isnan(first) & ~np.isnan(last) & (last > first) & (cols.prompt >= 0)
        return dec, dec & (cols.steps > 0) & (first >= lo) & (last <= hi)

    @classmethod
    def of(cls, cols: WindowColumns, lo: float, hi: float) -> StepRows | None:
        first, last = cols.first_token_at, cols.last_token_at
        steps = cols.steps.astype(float)
        ctx = np.maximum(cols.prompt, 0) + np.maximum(cols.output, 0) / 2.0
        dec, row = cls.decoding(cols, lo, hi)
        if row.sum() < MIN_REQUESTS:
            return None
        row = evenly_spaced(np.flatnonzero(row))  # (every decode still counts in each)
        a, b, n = first[row], last[row], steps[row]
        span = b - a
        both, decoding = decodes(cols)  # (dec, with the prompts unknown weighed 0)
        counted = dec[both].astype(float)
        batch, kv = (x / span for x in decoding.integrals(
            [None if counted.all() else counted, ctx[both] * counted], a, b))
        sched = cols.scheduled_at
        computed, pre = prefilled(cols)
        prefill = np.zeros(len(a))
        if pre.any():
            rate = computed[pre] / (first[pre] - sched[pre])
            prefill = Overlaps(sched[pre], first[pre],
                               cols.order_within("scheduled_at", pre),
                               cols.order_within("first_token_at", pre)
                               ).integral(rate, a, b) / n
        return cls(span / n, prefill, kv, batch, n, float(np.average(ctx[dec])))

    def correlation(self) -> float:
        """The steps-weighted correlation of the KV and the prefill tokens (0 where either
        is constant)."""
        cov = np.cov(self.kv, self.prefill, aweights=self.steps)
        den = float(np.sqrt(cov[0, 0] * cov[1, 1]))
        return float(cov[0, 1]) / den if den > 0 else 0.0

    def apart(self, x: np.ndarray) -> float:
        """How much input ``x`` (the KV or the prefill tokens) varied apart from the other:
        its ``spread`` times sqrt(1 - r^2), r their ``correlation``."""
        r = self.correlation()
        return self.spread(x) * float(np.sqrt(max(1.0 - r * r, 0.0)))

    def spread(self, x: np.ndarray) -> float:
        """The 10th-90th percentile range of an input over its mean (0 when constant)."""
        mean = float(np.average(x, weights=self.steps))
        low, high = np.quantile(x, [0.1, 0.9])
        return float(high - low) / mean if mean > 0 else 0.0


@dataclass(frozen=True)
class Floors:
    """The roofline's cost of each term: the weights read once per step (at the mean
    batch), a KV token, a prompt token, at the achievable bandwidth and FLOP/s."""

    base: float
    per_kv_token: float
    per_prefill_token: float

    @classmethod
    def of(cls, dep: Deployment, batch: float) -> Floors | None:
        bw = dep.hardware.achievable_bandwidth
        if not bw:
            return None
        flops = dep.hardware.achievable_flops(dep.compute_dtype) if dep.peak_flops else 0.0
        m = dep.model
        prefill = 2.0 * m.active_params / flops if flops else 0.0
        return cls(float(model_costs.weight_bytes_read(m, batch)) / bw,
                   model_costs.kv_bytes_per_token(m) / bw, prefill)


@dataclass(frozen=True)
class StepFit:
    """The fitted step: its three costs (seconds), how it was made and how well it holds
    (the steps-weighted median and 90th percentile of |fitted - measured| / measured
    over the rows), and the ranges it was fitted on (predictions past them say so)."""

    base: float
    per_prefill_token: float
    per_kv_token: float
    requests: int
    error_median: float
    error_p90: float
    batch_range: tuple[float, float]
    kv_range: tuple[float, float]
    prefill_range: tuple[float, float]
    context: float  # KV tokens one decoding sequence holds, on average
    held: tuple[str, ...] = ()  # costs held at the roofline's, and why
    rejected: str | None = None  # why no prediction rests on it
    floors: Floors | None = None

    def step(self, prefill_tokens: float, kv_tokens: float) -> float:
        return (self.base + self.per_prefill_token * prefill_tokens
                + self.per_kv_token * kv_tokens)

    def at_batch(self, batch: float, prefill_tokens: float = 0.0) -> float:
        """A step at ``batch`` decoding sequences of the window's mean context."""
        return self.step(prefill_tokens, batch * self.context)

    def reach(self, kv_tokens: float) -> float:
        """How far ``kv_tokens`` is past the fitted range (1: inside it; 2: twice its
        top, or half its bottom)."""
        low, high = self.kv_range
        if kv_tokens > high * 1.05:
            return kv_tokens / high
        if kv_tokens < low * 0.95:
            return low / max(kv_tokens, 1e-12)
        return 1.0

    def as_dict(self) -> dict:
        out = {"base_seconds": self.base, "per_prefill_token_seconds": self.per_prefill_token,
               "per_kv_token_seconds": self.per_kv_token, "requests": self.requests,
               "error_median": self.error_median, "error_p90": self.error_p90,
               "batch_range": list(self.batch_range), "kv_tokens_range": list(self.kv_range),
               "prefill_tokens_range": list(self.prefill_range),
               "context_tokens": self.context, "held_at_roofline": list(self.held)}
        if self.floors is not None:
            out["roofline"] = {"base_seconds": self.floors.base,
                               "per_kv_token_seconds": self.floors.per_kv_token,
                               "per_prefill_token_seconds": self.floors.per_prefill_token}
        if self.rejected:
            out["rejected"] = self.rejected
        return out


def _solve(rows: StepRows, free: list[str], fixed: dict[str, float]) -> dict[str, float]:
    """Weighted least squares of the step on the ``free`` terms, with ``fixed`` terms'
    costs subtracted first."""
    cols = {"base": np.ones(len(rows.step)), "per_prefill_token": rows.prefill,
            "per_kv_token": rows.kv}
    y = rows.step - sum(cost * cols[name] for name, cost in fixed.items())
    w = np.sqrt(rows.steps)
    x = np.column_stack([cols[name] for name in free]) * w[:, None]
    coef, *_ = np.linalg.lstsq(x, y * w, rcond=None)
    return {**fixed, **dict(zip(free, (float(c) for c in coef), strict=True))}


def _weighted_quantile(x: np.ndarray, w: np.ndarray, q: float) -> float:
    order = np.argsort(x)
    cum = np.cumsum(w[order])
    return float(x[order][np.searchsorted(cum, q * cum[-1])])


def unfitted(cols: WindowColumns, lo: float, hi: float) -> str:
    """Why ``fit`` gave none over [lo, hi]: too few requests decoded wholly inside it."""
    dec, row = StepRows.decoding(cols, lo, hi)
    return (f"{int(row.sum())} of the {int(dec.sum())} requests that decoded in the window "
            f"did so wholly inside the {hi - lo:.3g} s range; the step model needs "
            f"{MIN_REQUESTS} (requests this long need a longer --window-seconds)")


def fit(cols: WindowColumns, lo: float, hi: float, dep: Deployment | None,
        batch: float | None = None) -> StepFit | None:
    """The step model over [lo, hi] (see the module docstring); None with fewer than
    ``MIN_REQUESTS`` decoding requests inside it."""
    rows = StepRows.of(cols, lo, hi)
    if rows is None:
        return None
    mean_batch = batch or float(np.average(rows.batch, weights=rows.steps))
    return fit_rows(rows, Floors.of(dep, mean_batch) if dep is not None else None)


TERMS = ("base", "per_prefill_token", "per_kv_token")
SLOPES = ("per_kv_token", "per_prefill_token")


def _held_fit(rows: StepRows, roof: dict[str, float]) -> tuple[dict, dict, list[str]]:
    """(costs, the costs held at the roofline's, why each was): an input that barely
    varied, then a cost fitted under the roofline's, held and the rest refitted."""
    fixed, held = {}, []
    inputs = (("per_kv_token", rows.kv, "the KV tokens read"),
              ("per_prefill_token", rows.prefill, "the prefill tokens"))
    for name, x, what in inputs:
        if rows.spread(x) < SPREAD:
            fixed[name] = roof[name]
            held.append(f"{name}: {what} barely varied in the window")
    free = None if fixed else _solve(rows, list(TERMS), {})
    if free is not None:
        name, x, what = min(inputs, key=lambda i: rows.spread(i[1]))
        apart = rows.apart(x)
        scatter = _weighted_quantile(_error(rows, free), rows.steps, 0.5)
        if apart < max(APART, NOISE * scatter):
            fixed[name] = roof[name]
            other = "the prefill tokens" if name == "per_kv_token" else "the KV tokens read"
            held.append(f"{name}: {what} varied {apart:.1%} of their mean apart from "
                        f"{other} (correlation {rows.correlation():.2f}; the free fit's "
                        f"median error {scatter:.1%}): the window tells their summed cost, "
                        "not each one's, so these, which varied the least, are held")
    coef = (free if free is not None and not fixed
            else _solve(rows, [n for n in TERMS if n not in fixed], fixed))
    for _ in range(2):
        low = [n for n in SLOPES if n not in fixed and coef[n] < FLOOR_SLACK * roof[n]]
        if not low:
            break
        for name in low:
            fixed[name] = roof[name]
            held.append(f"{name}: the fit read {coef[name]:.3g} s, under the roofline's "
                        f"{roof[name]:.3g} s")
        coef = _solve(rows, [n for n in TERMS if n not in fixed], fixed)
    return coef, fixed, held


def _line(coef: dict, prefill_tokens, kv_tokens):
    """The step ``coef`` (``_solve``'s costs by term) gives at those inputs."""
    return (coef["base"] + coef["per_prefill_token"] * prefill_tokens
            + coef["per_kv_token"] * kv_tokens)


def _error(rows: StepRows, coef: dict) -> np.ndarray:
    return np.abs(_line(coef, rows.prefill, rows.kv) - rows.step) / rows.step


def _separated(rows: StepRows, roof: dict[str, float], floor: float, fixed: dict,
               coef: dict) -> tuple[dict, list[str]] | None:
    """Where the free fit put the fixed cost under the weights' read (inputs that move
    together: a larger context beside every longer prompt), the window cannot tell the
    costs apart: each slope not yet held is held at the roofline's in turn, and both
    together, and the refit whose fixed cost clears the floor with the smallest error
    stands; None where none does."""
    best = None
    free = [n for n in SLOPES if n not in fixed]
    choices = [[n] for n in free] + ([free] if len(free) > 1 else [])
    for hold in choices:
        trial = {**fixed, **{n: roof[n] for n in hold}}
        c = _solve(rows, [n for n in TERMS if n not in trial], trial)
        if c["base"] < FLOOR_SLACK * floor or any(
                c[n] < FLOOR_SLACK * roof[n] for n in SLOPES if n not in trial):
            continue
        err = float(np.average(_error(rows, c), weights=rows.steps))
        if best is None or err < best[0]:
            best = (err, c, hold)
    if best is None:
        return None
    _, c, hold = best
    why = (f"the free fit put a step's fixed cost at {coef['base'] * 1e3:.3g} ms, under the "
           f"weights' read ({floor * 1e3:.3g} ms): the window could not tell it apart from "
           "the other costs")
    return c, [f"{n}: {why}" for n in hold]


def fit_rows(rows: StepRows, floors: Floors | None) -> StepFit:
    """The step model through ``rows`` with the roofline's ``floors`` as its prior."""
    roof = {n: getattr(floors, n) if floors else 0.0 for n in SLOPES}
    coef, fixed, held = _held_fit(rows, roof)
    rejected = None
    if floors is not None and coef["base"] < FLOOR_SLACK * floors.base:
        found = _separated(rows, roof, floors.base, fixed, coef)
        if found is not None:
            coef, more = found
            held = [*held, *more]
        else:
            rejected = (f"the fitted fixed cost of a step, {coef['base'] * 1e3:.2f} ms, is "
                        f"under the weights' read at the achievable bandwidth, "
                        f"{floors.base * 1e3:.2f} ms, however the other costs are held: the "
                        "configured model or hardware does not fit these steps")
    elif coef["base"] <= 0:
        rejected = "the fitted fixed cost of a step is not positive"
    err = _error(rows, coef)

    def span(x: np.ndarray) -> tuple[float, float]:
        return tuple(float(v) for v in np.quantile(x, [0.1, 0.9]))
    return StepFit(coef["base"], coef["per_prefill_token"], coef["per_kv_token"],
                   len(rows.step), _weighted_quantile(err, rows.steps, 0.5),
                   _weighted_quantile(err, rows.steps, 0.9), span(rows.batch),
                   span(rows.kv), span(rows.prefill), rows.context, tuple(held),
                   rejected, floors)
