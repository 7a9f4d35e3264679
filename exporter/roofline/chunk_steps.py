"""The window's engine steps at a prefill chunk budget, for ``lever_effects``'s
``prefill_interference``: what a smaller ``--max-num-batched-tokens`` would do to ITL.

Every prompt prefilled in the window takes ceil(prompt / budget) chunk steps of equal
size (vLLM's scheduler cuts a prompt at the budget's remainder; equal chunks keep the
sum and the count), each a decode step too: the fit's step at the window's batch with
that chunk beside it. The rest of the time runs decode-only steps (the fit at the batch
alone). A step gives every decoding sequence one token, so the ITLs are the steps'
durations, each kind counted by how many ran: ITL p50 and p99 are that mixture's.
Prompts that overlap would share chunk steps at a larger budget; here each runs its
own, which is right where prefills come one at a time and overstates the chunk steps
(the tail's share) where many arrive together. The engine is taken as busy the whole
range (the verdict that names this lever is on a busy one): an idle share would be
counted as decode-only steps, understating the chunk steps' share.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from phasewatch.roofline.step_model import StepFit


@dataclass(frozen=True)
class ChunkSteps:
    """The window's steps at one chunk budget: each kind's duration and how many ran a
    second; the seconds a prefill's chunk steps take, on average."""

    durations: np.ndarray
    per_second: np.ndarray
    prefill_seconds: float
    # each prompt's chunk steps' seconds, in the order given (NaN for an empty prompt)
    per_prompt: np.ndarray | None = None

    def itl(self, q: float) -> float:
        """The q-th percentile (0..100) of the steps' durations: an ITL is a step."""
        order = np.argsort(self.durations, kind="stable")
        cum = np.cumsum(self.per_second[order])
        at = int(np.searchsorted(cum, q / 100.0 * cum[-1]))
        return float(self.durations[order][min(at, len(order) - 1)])

    @property
    def mean(self) -> float:
        """The mean step: time over steps."""
        return float((self.durations * self.per_second).sum() / self.per_second.sum())


def chunk_steps(prompts, prefills_per_second: float, batch: float, fit: StepFit,
                budget: int, scale: float = 1.0) -> ChunkSteps | None:
    """The steps at ``budget`` (the module docstring): ``prompts`` the computed prompt
    tokens of (a sample of) the window's prefills, which ran ``prefills_per_second``;
    durations times ``scale``. None without prompts, or where the chunk steps alone would
    fill the time."""
    given = np.asarray(prompts, dtype=float)
    p = given[given > 0]
    if not len(p) or budget < 1 or prefills_per_second <= 0:
        return None
    k = np.ceil(p / budget)
    chunk = scale * np.asarray(fit.at_batch(batch, p / k), dtype=float)
    solo = scale * float(fit.at_batch(batch, 0.0))
    each = prefills_per_second / len(p)  # prefills a second each prompt stands for
    busy = each * float((k * chunk).sum())  # seconds of chunk steps a second
    if busy >= 1.0 or solo <= 0 or np.any(chunk <= 0):
        return None
    per_prompt = np.full(len(given), np.nan)
    per_prompt[given > 0] = k * chunk
    return ChunkSteps(np.concatenate([[solo], chunk]),
                      np.concatenate([[(1.0 - busy) / solo], k * each]),
                      float((k * chunk).mean()), per_prompt)
