"""Request streams for the simulator: arrivals and prompt/output length distributions."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Lengths:
    """Log-normal token counts with the given mean, clipped to [lo, hi]."""

    mean: float
    sigma: float = 0.5
    lo: int = 1
    hi: int = 131072

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.sigma == 0:
            return np.full(n, round(self.mean), dtype=np.int64)
        mu = math.log(self.mean) - self.sigma**2 / 2  # so that E[X] = mean before clipping
        return np.clip(np.rint(rng.lognormal(mu, self.sigma, n)), self.lo, self.hi).astype(
            np.int64)


@dataclass(frozen=True)
class Workload:
    """Either open-loop Poisson arrivals (``rate`` req/s) or a closed loop of ``concurrency``
    users that send the next request as soon as the previous one finishes."""

    prompt: Lengths
    output: Lengths
    rate: float | None = None
    concurrency: int | None = None
    prefix_hit_probability: float = 0.0  # chance a request's prompt starts with a cached prefix
    prefix_fraction: float = 0.5  # share of the prompt that prefix covers when it hits

    def __post_init__(self):
        if (self.rate is None) == (self.concurrency is None):
            raise ValueError("a workload needs exactly one of rate (Poisson) or concurrency "
                             "(closed loop)")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if not 0 <= self.prefix_hit_probability <= 1 or not 0 <= self.prefix_fraction <= 1:
            raise ValueError("prefix_hit_probability and prefix_fraction must be in [0, 1]")

    def draw(self, rng: np.random.Generator) -> tuple[int, int, int]:
        """One request: (prompt tokens, cached prompt tokens, output tokens)."""
        prompt = int(self.prompt.sample(rng, 1)[0])
        output = int(self.output.sample(rng, 1)[0])
        cached = 0
        if self.prefix_hit_probability and rng.random() < self.prefix_hit_probability:
            cached = min(prompt - 1, int(prompt * self.prefix_fraction))
        return prompt, cached, output
