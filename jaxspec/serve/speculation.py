"""Speculation that adapts to the load: per tick, the budget and row bucket worth most.

A draft budget pays when the tokens it adds per step outweigh what it adds to the step's
cost, and both sides move while serving: the step's cost grows with the live rows (on an
accelerator a wide verify over many rows stops being free once the step turns compute-bound),
and the tokens a budget adds depend on what users send (code or chat, greedy or T = 1). An
engine built with `EngineConfig(speculation="auto", row_buckets=...)` runs any of a few
budgets (`SpecEngine.budgets`, 0 = no proposal) on any row bucket, each compiled once; this
policy picks, for a tick with n live rows, the smallest bucket that holds them and the budget
b that maximises

    n · E[b] / cost[b, bucket]

the expected tokens per second: E[b] the tokens a row commits per step under b, measured from
the rows' counters each tick (E[0] = 1 exactly), and cost the seconds per step, measured for
every program at start (`SpecEngine.measure_step_costs`) and refined by every tick's time.
A budget whose estimate is missing or older than `explore_every` ticks is tried once (the
stalest first), so the estimates follow the traffic.

Chains (`depth_model`): a budget b < γ checks the first b drafts of the same chain, so a
draft at position k is accepted, given the k − 1 before it were, with one probability p_k
whatever the budget. The policy measures p_k per draft position from the rows' acceptance
histograms (counts of passes that reached position k and that accepted it, halved every
`half_life` passes at that position, so a tick of few rows moves them little) and predicts
every budget from them once each of its positions has `min_passes` passes behind it:

    E[b] = 1 + Σ_{k ≤ b} p_1 · … · p_k

so running the full budget measures every shorter one, and a budget is explored only when a
position it drafts has gone unmeasured (then the longest such budget: it measures the
others). Trees with fewer nodes are different trees: each budget's E is measured by running
it.
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

import numpy as np


def default_row_buckets(batch: int) -> tuple[int, ...]:
  """Row buckets for a batch of `batch` slots: a quarter and a sixteenth of it (at least 1),
  so a lightly loaded server steps few rows; the batch itself is always one."""
  return tuple(sorted({max(1, batch // 4), max(1, batch // 16)} - {batch}))


class SpeculationPolicy:
  """Chooses (budget, row bucket) per tick from measured costs and acceptance.

  Args:
    budgets: the engine's budgets (`SpecEngine.budgets`), ascending.
    buckets: the engine's row buckets (`SpecEngine.row_buckets`), ascending; the last is the
      batch size.
    costs: {(budget, bucket): seconds per step} (`SpecEngine.measure_step_costs`); None or a
      missing entry: that budget is only chosen to explore it.
    explore_every: ticks after which a budget's acceptance is measured again.
    smoothing: weight of the newest measurement in the running estimates.
    depth_model: chain budgets: predict each budget from acceptance per draft position
      (`observe`'s `accepted`); else each budget's tokens per step are measured alone.
    min_passes: depth model: passes a position needs before budgets drafting it are
      predicted (until then the longest such budget is explored).
    half_life: depth model: passes at a position after which older counts weigh half.
  """

  def __init__(
    self,
    budgets: Sequence[int],
    buckets: Sequence[int],
    costs: Optional[dict[tuple[int, int], float]] = None,
    explore_every: int = 32,
    smoothing: float = 0.3,
    depth_model: bool = False,
    min_passes: int = 16,
    half_life: float = 64.0,
  ):
    if not budgets or not buckets or explore_every < 1 or not 0 < smoothing <= 1:
      raise ValueError("a policy needs budgets, buckets, explore_every ≥ 1, smoothing in (0, 1]")
    self.budgets = tuple(sorted(budgets))
    self.buckets = tuple(sorted(buckets))
    self.costs = dict(costs or {})
    self.explore_every = explore_every
    self.smoothing = smoothing
    # Tokens a row commits per step, per budget (0: exactly one, never explored).
    self.tokens_per_step: dict[int, Optional[float]] = {b: None for b in self.budgets}
    if 0 in self.tokens_per_step:
      self.tokens_per_step[0] = 1.0
    self._measured_at: dict[int, float] = {b: float("-inf") for b in self.budgets}
    self._measured_at[0] = float("inf")
    self._tick = 0
    self.chosen: collections.Counter = collections.Counter()  # (budget, bucket) → ticks
    self.depth_model = depth_model
    self.min_passes, self.half_life = min_passes, half_life
    # Per draft position k = 1..γ: decayed counts of passes that reached it and that accepted
    # it, and the tick it was last measured at (depth_model only).
    depths = range(1, max(self.budgets) + 1)
    self._reached = {k: 0.0 for k in depths}
    self._accepted = {k: 0.0 for k in depths}
    self._depth_at = {k: float("-inf") for k in depths}

  def acceptance_by_position(self) -> dict[int, Optional[float]]:
    """p_k: how often a draft at position k is accepted given those before it were (None:
    not measured yet); `depth_model` only."""
    return {k: self._accepted[k] / r if r else None for k, r in self._reached.items()}

  def bucket_for(self, live: int) -> int:
    """The smallest bucket that holds `live` rows."""
    return next((b for b in self.buckets if b >= live), self.buckets[-1])

  def expected_rate(self, budget: int, live: int) -> Optional[float]:
    """Expected tokens per second of `budget` for `live` rows (None: not measured yet)."""
    per_step = self.tokens_per_step[budget]
    cost = self.costs.get((budget, self.bucket_for(live)))
    if per_step is None or not cost:
      return None
    return live * per_step / cost

  def choose(self, live: int) -> tuple[int, int]:
    """(budget, bucket) for a tick of `live` rows."""
    self._tick += 1
    choice = self.budgets[-1], self.bucket_for(live)
    if len(self.budgets) > 1:
      choice = self._best(live), choice[1]
    self.chosen[choice] += 1
    return choice

  def _best(self, live: int) -> int:
    stale = [b for b in self.budgets if self._tick - self._measured_at[b] > self.explore_every]
    if stale and self.depth_model:  # the longest stale chain measures the shorter ones too
      return max(stale)
    if stale:  # explore: the budget measured longest ago
      return min(stale, key=lambda b: self._measured_at[b])
    rates = {b: self.expected_rate(b, live) for b in self.budgets}
    known = {b: r for b, r in rates.items() if r is not None}
    return max(known, key=known.get) if known else self.budgets[-1]

  def observe(
    self,
    budget: int,
    bucket: int,
    steps: int,
    seconds: float,
    passes: int,
    committed: int,
    accepted: Optional[Sequence[int]] = None,
  ) -> None:
    """A tick's outcome: `steps` steps of (budget, bucket) took `seconds`; its rows ran
    `passes` row-steps in all and committed `committed` tokens; `accepted[j]`: how many of
    those passes accepted exactly j drafts (the depth model reads it)."""
    if steps > 0 and seconds > 0:
      self._blend(self.costs, (budget, bucket), seconds / steps)
    if passes <= 0 or budget == 0:
      return
    if not self.depth_model:
      self._blend(self.tokens_per_step, budget, committed / passes)
      self._measured_at[budget] = self._tick
    elif accepted is not None:
      self._observe_depths(budget, np.asarray(accepted, np.float64))

  def _observe_depths(self, budget: int, accepted: np.ndarray) -> None:
    """Counts for positions 1..budget from a tick's histogram, then every budget's E."""
    at_least = np.cumsum(accepted[::-1])[::-1]  # passes accepting ≥ j drafts
    for k in range(1, min(budget, len(accepted) - 1) + 1):
      if at_least[k - 1] > 0:
        keep = 0.5 ** (at_least[k - 1] / self.half_life)
        self._reached[k] = keep * self._reached[k] + at_least[k - 1]
        self._accepted[k] = keep * self._accepted[k] + at_least[k]
        self._depth_at[k] = self._tick
    p = self.acceptance_by_position()
    for b in self.budgets:
      if b == 0 or any(self._reached[k] < self.min_passes for k in range(1, b + 1)):
        continue
      self.tokens_per_step[b] = 1.0 + float(np.sum(np.cumprod([p[k] for k in range(1, b + 1)])))
      self._measured_at[b] = min(self._depth_at[k] for k in range(1, b + 1))

  def _blend(self, table: dict, key, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - self.smoothing) * old + self.smoothing * value
