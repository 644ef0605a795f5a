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
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence


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
  """

  def __init__(
    self,
    budgets: Sequence[int],
    buckets: Sequence[int],
    costs: Optional[dict[tuple[int, int], float]] = None,
    explore_every: int = 32,
    smoothing: float = 0.3,
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
    if stale:  # explore: the budget measured longest ago
      return min(stale, key=lambda b: self._measured_at[b])
    rates = {b: self.expected_rate(b, live) for b in self.budgets}
    known = {b: r for b, r in rates.items() if r is not None}
    return max(known, key=known.get) if known else self.budgets[-1]

  def observe(
    self, budget: int, bucket: int, steps: int, seconds: float, passes: int, committed: int
  ) -> None:
    """A tick's outcome: `steps` steps of (budget, bucket) took `seconds`; its rows ran
    `passes` row-steps in all and committed `committed` tokens."""
    if steps > 0 and seconds > 0:
      self._blend(self.costs, (budget, bucket), seconds / steps)
    if passes > 0 and budget != 0:
      self._blend(self.tokens_per_step, budget, committed / passes)
      self._measured_at[budget] = self._tick

  def _blend(self, table: dict, key, value: float) -> None:
    old = table.get(key)
    table[key] = value if old is None else (1 - self.smoothing) * old + self.smoothing * value
