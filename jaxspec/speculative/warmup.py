"""Warm-up and step costs of `SpecEngine`: compile before serving, measure before choosing.

`warm_up_slots` runs every program a slot-served engine will run (the prefill of every prompt
bucket and choice group, insert, evict, every speculation budget's loop on every row bucket)
once, so that serving never compiles; `measure_step_costs` times each (budget, row bucket)
loop on this machine, what `EngineConfig(speculation="auto")` starts from
(jaxspec/serve/speculation.py).
"""

from __future__ import annotations

import time
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import distributed
from jaxspec.speculative.request import SamplingArgs
from jaxspec.speculative.step import SpecState


class WarmUpMethods:
  """`SpecEngine`'s warm-up and cost measurement (a mixin over its slot API and `run`)."""

  def warm_up_slots(self) -> SpecState:
    """Compiles everything a slot-served engine runs (the one-row prefill of every prompt
    bucket, and the group prefills of up to `warm_choices` choices, insert, evict, the
    stepping loop) and returns a free state, so that serving never compiles. Prompts longer
    than prefill_chunk share the last bucket's chunked program."""
    state = self.empty_state()
    cfg = self.config
    if cfg.page_size:  # every page unmapped: the allocator maps them as rows arrive
      state = self.set_page_table(
        state, np.full((cfg.batch_size, cfg.pages_per_row), cfg.num_pages, np.int32)
      )
    longest = cfg.max_len - self.lookahead - 2  # the longest prompt a request may have
    top = cfg.prefill_width(longest)
    size = cfg.min_prompt_bucket
    groups = sorted({self.choice_group(n) for n in range(2, cfg.warm_choices + 1)})
    while longest >= 1:
      n = min(size, longest)  # the longest prompt of this bucket that fits
      state = self.insert(state, 0, self._warm_row(state, [0] * n, 1))
      for rows in groups:  # n > 1 choices of one prompt: one prefill per group size
        state = self.insert_rows(state, range(rows), self._warm_row(state, [0] * n, 1, rows))
      if cfg.prefill_width(n) >= top:
        break
      size *= 2
    for budget in self.budgets:  # every budget's program on every row bucket
      for bucket in self.row_buckets:
        state = self.run(state, cfg.stream_every, budget, rows=range(bucket))
    return self.evict(state, jnp.arange(cfg.batch_size))

  def measure_step_costs(
    self, state: SpecState, steps: Optional[int] = None
  ) -> tuple[SpecState, dict[tuple[int, int], float]]:
    """Seconds per step of every (budget, row bucket) program on this machine, every slot
    busy with a dummy request (what `speculation="auto"` starts from; a server refines them
    as it runs). Returns the state with every row free again (paged: every page unmapped)
    and {(budget, bucket): seconds}. Donates `state`."""
    cfg = self.config
    steps = steps or cfg.stream_every
    if cfg.page_size:  # every row the same pages: only the time matters here
      table = np.tile(np.arange(cfg.pages_per_row) % cfg.num_pages, (cfg.batch_size, 1))
      state = self.set_page_table(state, table.astype(np.int32))
    room = min(2 * steps * self.verifier.max_commit + 1, self.max_new_tokens_for(1))
    prompt = [0]
    costs: dict[tuple[int, int], float] = {}
    for budget in self.budgets:
      for bucket in self.row_buckets:
        best = float("inf")
        for _ in range(2):
          row = self._warm_row(state, prompt, room)
          for slot in range(cfg.batch_size):
            state = self.insert(state, slot, row)
          before = int(distributed.gather(state.stats.target_passes)[0])
          jax.block_until_ready(state)
          t0 = time.perf_counter()
          state = self.run(state, steps, budget, rows=range(bucket))
          jax.block_until_ready(state)
          elapsed = time.perf_counter() - t0
          ran = int(distributed.gather(state.stats.target_passes)[0]) - before
          best = min(best, elapsed / max(ran, 1))
        costs[(budget, bucket)] = best
    state = self.evict(state, jnp.arange(cfg.batch_size))
    if cfg.page_size:
      unmapped = np.full((cfg.batch_size, cfg.pages_per_row), cfg.num_pages, np.int32)
      state = self.set_page_table(state, unmapped)
    return state, costs

  def _warm_row(
    self, state: SpecState, prompt: list[int], max_new: int, rows: int = 1
  ) -> SpecState:
    """A greedy state of `prompt`, one row or a group of `rows` choices, through the program a
    server runs (prefix-cache engines: `prefill_cached`, with nothing cached)."""
    args = SamplingArgs(max_new_tokens=max_new, temperature=0.0)
    group = [args] * rows if rows > 1 else None
    if self.config.prefix_cache:
      return self.prefill_cached(state, prompt, group or args)
    return self.prefill_rows(prompt, group) if group else self.prefill_row(prompt, args)

