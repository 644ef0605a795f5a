"""A scheduler tick as data, and the engine calls that run it.

Each round the scheduler decides a `Tick` (the page tables, the requests to prefill and insert,
the slots to evict, the steps to run with their speculation budget and rows) and runs it with
`apply_tick` (`admit_tick`, then `run_tick`, whose `read_back` brings only what the steps
produced to the host). In a multi-host run the leader publishes each Tick before it runs and
every follower replays it with the same functions (jaxspec/serve/multihost.py), so every
process makes the same engine calls and collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Optional

import numpy as np

from jaxspec import distributed
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.request import SamplingArgs
from jaxspec.speculative.step import SpecState


@dataclasses.dataclass(frozen=True)
class Tick:
  """One scheduler round's engine calls, all a follower process needs to replay it: set the
  page tables (paged K/V), prefill and insert each admitted request, evict slots, run `steps`
  steps (0: none) and read back."""

  # [slot, prompt token ids, SamplingArgs.to_json(), cached pages] per admitted request; n > 1:
  # [slots, prompt token ids, one SamplingArgs.to_json() per choice, cached pages] (prefilled
  # once). Cached pages (optional): the pool pages holding the prompt's first pages.
  admit: list
  evict: list[int]  # slots to free
  steps: int
  stop: bool = False  # the leader's last tick: followers return
  pages: Optional[list] = None  # paged K/V: every row's page table, set first (None: unchanged)
  budget: Optional[int] = None  # the steps' speculation budget (None: the engine's full one)
  live: Optional[list] = None  # the rows the steps run (None: all; SpecEngine.run's rows)

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "Tick":
    return cls(**json.loads(text))


def apply_tick(
  engine: SpecEngine, state: SpecState, tick: Tick
) -> tuple[SpecState, dict[str, np.ndarray] | None]:
  """`tick`'s engine calls on `state`, in a fixed order (the leader's scheduler and every
  follower run these, so their collectives match): the new state, and when it ran steps the
  rows' progress read back to the host (gathered from every process)."""
  return run_tick(engine, admit_tick(engine, state, tick), tick.steps, tick.budget, tick.live)


def admit_tick(engine: SpecEngine, state: SpecState, tick: Tick) -> SpecState:
  """`apply_tick`'s first half: page tables, prefill + insert each admitted request, evict."""
  if tick.pages is not None:
    state = engine.set_page_table(state, np.asarray(tick.pages, np.int32))
  for slot, ids, arguments, *cached in tick.admit:
    cached = cached[0] if cached else []
    group = isinstance(slot, list)  # n > 1: one prefill, a row per choice
    args = [SamplingArgs(**a) for a in arguments] if group else SamplingArgs(**arguments)
    if engine.config.prefix_cache:  # reads the cached pages from the pool as it stands
      rows = engine.prefill_cached(state, ids, args, cached)
    else:
      rows = engine.prefill_rows(ids, args) if group else engine.prefill_row(ids, args)
    state = engine.insert_rows(state, slot, rows) if group else engine.insert(state, slot, rows)
  if tick.evict:
    state = engine.evict(state, tick.evict)
  return state


def run_tick(
  engine: SpecEngine,
  state: SpecState,
  steps: int,
  budget: Optional[int] = None,
  live: Optional[list] = None,
) -> tuple[SpecState, dict[str, np.ndarray] | None]:
  """`apply_tick`'s second half: `steps` steps (0: none) of `budget` over the rows `live`
  (None: all) and the read-back."""
  if not steps:
    return state, None
  state = engine.run(state, steps, budget, live)
  return state, read_back(engine, state, engine.window(steps))


def read_back(engine: SpecEngine, state: SpecState, window: int) -> dict[str, np.ndarray]:
  """What a tick produced, on the host: per row the last `window` tokens and log-probs (a
  tick of k steps commits at most window = 1 + k·(γ+1) of them, the first counting the token
  sampled at prefill), the lengths, done and stop flags and counters (`SpecEngine.recent`).
  Its size does not grow with max_len."""
  return distributed.gather(engine.recent(state, window))
