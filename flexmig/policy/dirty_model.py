"""The dirty-page model of seed 000, fitted by least squares.

D(t) = M - M * (1/2) ** (t * (1 - beta) / tau)

D(t) is the number of distinct pages a workload dirties in an interval of t
seconds, M the pages it rewrites at all (its writable working set), tau the
half-life (the time in which half of M gets dirtied) and beta the CPU share
taken from the guest by the migration (which slows its dirtying).  A workload
writing R pages/s uniformly at random over W pages follows it exactly with
M = W and tau = W * ln 2 / R.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from flexmig import exceptions

# tau is searched over this range (seconds): from a workload that fills its
# set almost at once to one that barely moves within a migration.
TAU_MIN = 1e-3
TAU_MAX = 1e4
_GRID = 400
_REFINE_STEPS = 80


@dataclasses.dataclass(frozen=True)
class DirtyModel:
    m_pages: float
    tau_s: float
    beta: float = 0.0

    def pages(self, t: float) -> float:
        """Distinct pages dirtied in an interval of ``t`` seconds.

        >>> DirtyModel(m_pages=1000, tau_s=2.0).pages(2.0)
        500.0
        """
        if t <= 0 or self.m_pages <= 0:
            return 0.0
        return self.m_pages * (1.0 - 0.5 ** (t * (1.0 - self.beta) / self.tau_s))

    def initial_rate(self) -> float:
        """Pages/s at t -> 0 (the slope of D at the origin)."""
        if self.m_pages <= 0:
            return 0.0
        return self.m_pages * math.log(2) * (1.0 - self.beta) / self.tau_s

    def with_beta(self, beta: float) -> DirtyModel:
        return dataclasses.replace(self, beta=beta)


IDLE = DirtyModel(m_pages=0.0, tau_s=1.0)


def _m_for_tau(
    samples: Sequence[tuple[float, float]], tau: float, max_pages: float
) -> tuple[float, float]:
    """Best M for a fixed tau (closed form: D is linear in M) and its squared error.

    M is clamped to ``max_pages``: a guest cannot dirty more distinct pages
    than it has, however linear a short sample looks.
    """
    gs = [1.0 - 0.5 ** (t / tau) for t, _ in samples]
    denom = sum(g * g for g in gs)
    if denom == 0:
        return 0.0, math.inf
    m = sum(g * d for g, (_, d) in zip(gs, samples, strict=True)) / denom
    m = min(max(0.0, m), max_pages)
    err = sum((m * g - d) ** 2 for g, (_, d) in zip(gs, samples, strict=True))
    return m, err


def fit(samples: Sequence[tuple[float, float]], max_pages: float = math.inf) -> DirtyModel:
    """Least-squares fit of (M, tau) to (interval seconds, distinct pages) samples.

    Needs at least two distinct intervals to tell M from tau.  A log-spaced grid
    over tau finds the basin, golden-section search refines it.

    >>> truth = DirtyModel(m_pages=1.00e5, tau_s=1.32)
    >>> est = fit([(t, truth.pages(t)) for t in (0.5, 1, 2, 4)])
    >>> round(est.m_pages), round(est.tau_s, 2)
    (100000, 1.32)
    """
    clean = [(float(t), float(d)) for t, d in samples if t > 0 and d >= 0]
    if len({t for t, _ in clean}) < 2:
        raise exceptions.InvalidInput(
            what="dirty-rate samples", reason="need at least two distinct interval lengths"
        )
    if all(d == 0 for _, d in clean):
        return IDLE
    log_lo, log_hi = math.log(TAU_MIN), math.log(TAU_MAX)
    grid = [math.exp(log_lo + (log_hi - log_lo) * i / _GRID) for i in range(_GRID + 1)]
    best = min(range(len(grid)), key=lambda i: _m_for_tau(clean, grid[i], max_pages)[1])
    lo = math.log(grid[max(best - 1, 0)])
    hi = math.log(grid[min(best + 1, _GRID)])
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(_REFINE_STEPS):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if (
            _m_for_tau(clean, math.exp(a), max_pages)[1]
            <= _m_for_tau(clean, math.exp(b), max_pages)[1]
        ):
            hi = b
        else:
            lo = a
    tau = math.exp((lo + hi) / 2)
    return DirtyModel(m_pages=_m_for_tau(clean, tau, max_pages)[0], tau_s=tau)
