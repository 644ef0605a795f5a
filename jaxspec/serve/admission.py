"""Admission by K/V memory: which waiting requests the pool can hold, and who gives way.

A `Scheduler` asks its admission policy, each tick, what rows may grow, whether a request's
rows fit, and what a row's end gives back. With contiguous K/V (`ContiguousAdmission`) every
row holds max_len positions, so a free row is all a request needs and every answer is "yes".
With paged K/V (`PagedAdmission`) rows hold pages of one pool (the page allocator,
serve/pages.py): a request is admitted when the pool has the pages its prompt and first tick
reach, beside a reserve kept for the running rows (`admission_reserve`); each tick every row
is given the pages its next tick may reach, oldest first, and where the pool runs out the
newest rows are preempted (their pages freed; they resume later from what they delivered).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jaxspec.errors import ConfigError, InputError
from jaxspec.serve.handles import RequestHandle, Slot
from jaxspec.serve.pages import PageAllocator
from jaxspec.speculative.engine import SpecEngine

# What a group's admission takes: (the positions each row reaches by its first read-back, the
# prompt's full pages the other choices share with the first, the free pages it takes in all,
# the cached pages its prompt starts with).
FirstPages = tuple[int, int, int, list[int]]


def parse_admission_reserve(text: str) -> Optional[float]:
  """A flag's admission reserve (`Scheduler(admission_reserve=)`): None for 'measured', else
  the share it names, in [0, 1]."""
  if text == "measured":
    return None
  try:
    share = float(text)
  except ValueError:
    share = -1.0
  if not 0.0 <= share <= 1.0:
    raise ConfigError(f"admission reserve {text!r}: expected 'measured' or a share in [0, 1]")
  return share


DEFAULT_PAGE_SIZE = 16  # vLLM's block size: small pages share more of a prompt's prefix


def default_page_size(max_len: int, page_size: Optional[int]) -> tuple[int, str]:
  """A server's page size and, when paging is off, why: `page_size` if given (0 = off), else
  16 or the largest power of two from 4 to 16 that divides `max_len` (a page must)."""
  if page_size is not None:
    return page_size, "--page_size=0" if page_size == 0 else ""
  size = DEFAULT_PAGE_SIZE
  while size >= 4 and max_len % size:
    size //= 2
  if size < 4:
    return 0, f"max_len={max_len} is not a multiple of 4; set --page_size to a divisor of it"
  return size, ""


def make(
  engine: SpecEngine, steps_per_tick: int, reserve: Optional[float]
) -> "ContiguousAdmission":
  """The admission policy of `engine`'s K/V: paged (EngineConfig.page_size) or contiguous."""
  if engine.config.page_size:
    return PagedAdmission(engine, steps_per_tick, reserve)
  return ContiguousAdmission()


class ContiguousAdmission:
  """Contiguous K/V: every row holds max_len positions; a free row is all a request needs.

  Also the policy interface (`PagedAdmission` answers the same calls): here every call is a
  no-op, and nothing is preempted.
  """

  reserve_ratio = 0.0  # reported as the admission reserve: none

  def check_group(self, handles: list[RequestHandle]) -> None:
    """Raises InputError when a group of choices could never be admitted."""

  def grow(self, active: Sequence[Optional[Slot]], cancelled: list[int]) -> list[int]:
    """Gives the running rows what their next tick may reach; returns the rows preempted."""
    return []

  def reserve(self, active: Sequence[Optional[Slot]], leaving: set[int]) -> int:
    """What admission keeps free for the running rows (not those `leaving` this tick)."""
    return 0

  def take(
    self, slots: list[int], members: list[RequestHandle], reserve: int, busy: bool
  ) -> Optional[tuple[list[int], int]]:
    """Admits a group into `slots` if the memory has room beside `reserve` (when `busy`: other
    rows run): (the cached pages its prompt starts with, what to add to the reserve), or
    None when it does not fit."""
    return [], 0

  def seated(self, slot: int, prompt: list[int], hits: list[int]) -> int:
    """A group was seated with `prompt` from `slot`: returns its prompt tokens served from the
    cache."""
    return 0

  def page_table(self) -> Optional[list]:
    """Every row's page table for the next tick (None: no paging)."""
    return None

  def held(self, slot: int) -> Optional[int]:
    """The positions a row's memory holds (None: all of max_len)."""
    return None

  def release(self, slot: int) -> None:
    """A row's memory back to the pool."""

  def finished(self, slot: int, handle: RequestHandle, reason: str) -> None:
    """A request left its row with `reason` (a FINISH_REASONS entry): its memory goes back."""
    self.release(slot)

  def preempted(self) -> None:
    """Rows were preempted this tick."""

  def metrics(self) -> dict[str, float]:
    """The pool's gauges and counters for /metrics."""
    return {
      "admission_reserve": 0.0,
      "kv_pages": 0,
      "kv_pages_used": 0,
      "prefix_cache_pages": 0,
      "prefix_cache_evictions_total": 0,
    }


class PagedAdmission(ContiguousAdmission):
  """Paged K/V: rows hold pages of one pool; admission and growth go by free pages.

  reserve: the share of each running request's way to its end (its remaining max_tokens)
    whose pages admission keeps free for it (0: none, the pool is packed and growth preempts;
    1: all, so no request is ever preempted). None: measured, the mean share of max_tokens
    finished requests used (from 1, raised halfway to 1 on each preemption).
  """

  def __init__(self, engine: SpecEngine, steps_per_tick: int, reserve: Optional[float]):
    cfg = engine.config
    self.pages = PageAllocator(
      cfg.num_pages, cfg.page_size, cfg.batch_size, cfg.pages_per_row, cfg.prefix_cache
    )
    self._engine = engine
    self._steps_per_tick = steps_per_tick
    # The share of a request's remaining max_tokens kept in reserve at admission.
    self._measure = reserve is None
    self.reserve_ratio = 1.0 if reserve is None else float(reserve)

  def reach(self, seq_len: int, handle: RequestHandle) -> int:
    """The positions a row of length `seq_len` may write before the next read-back: a tick's
    commits and one verify block past them, never past the request's own end (its prompt,
    max_tokens and the drafter's lookahead, however often it was preempted)."""
    verifier = self._engine.verifier
    ahead = seq_len + self._steps_per_tick * verifier.max_commit + verifier.width
    return min(ahead, self.end(handle))

  def end(self, handle: RequestHandle) -> int:
    """The most positions a request's row may write: its prompt, max_tokens and the
    drafter's lookahead (however often it was preempted), within max_len."""
    end = len(handle.prompt_ids) + handle.options.max_tokens + self._engine.lookahead + 1
    return min(end, self._engine.config.max_len)

  def kept(self, seq_len: int, handle: RequestHandle) -> int:
    """The positions admission keeps pages for, for a row of length `seq_len`:
    `reserve_ratio` of its way to its end."""
    end = self.end(handle)
    return min(end, seq_len + int(np.ceil(self.reserve_ratio * max(end - seq_len, 0))))

  def first_pages(self, handles: list[RequestHandle]) -> FirstPages:
    """What admitting a group (one request, or n choices of one prompt) takes (`FirstPages`).
    A cached page no row holds counts as free, so holding it takes one."""
    prompt = handles[0].row_prompt()
    reach = self.reach(len(prompt) + 1, handles[0])
    pages = self.pages.pages_for(reach)
    shared = min(len(prompt) // self.pages.page_size, pages)
    hits = self.pages.lookup(prompt)
    taken = pages - len(hits) + sum(self.pages.idle(p) for p in hits)
    return reach, shared, taken + (len(handles) - 1) * (pages - shared), hits

  def check_group(self, handles: list[RequestHandle]) -> None:
    if self.first_pages(handles)[2] > self.pages.num_pages:
      raise InputError(f"n={len(handles)}: the choices' first pages do not fit the KV pool")

  def grow(self, active: Sequence[Optional[Slot]], cancelled: list[int]) -> list[int]:
    """Frees the pages of cancelled rows and gives every other row the pages its next tick
    may reach, oldest row first; where the pool runs out, preempts the newest rows (frees their
    pages; they resume later from what they delivered). Returns the preempted."""
    for i in cancelled:
      self.pages.release(i)
    running = sorted(
      (s.admitted, i) for i, s in enumerate(active) if s is not None and i not in cancelled
    )
    preempted: list[int] = []
    while running:
      _, slot = running.pop(0)  # the oldest not yet grown
      s = active[slot]
      while not self.pages.grow(slot, self.reach(s.seq_len, s.handle)):
        # The newest row gives way; if that is this one, older rows hold the pool (the oldest
        # always fits: a request needs at most a row of pages, and the pool holds one).
        newest = running.pop()[1] if running else slot
        self.pages.release(newest)
        preempted.append(newest)
        if newest == slot:
          break
    return preempted

  def reserve(self, active: Sequence[Optional[Slot]], leaving: set[int]) -> int:
    """Pages kept free for the running rows (`kept`), so that admitting does not make them
    preempt one another later (reserve_ratio 1: never)."""
    reserve = 0
    for i, s in enumerate(active):
      if s is not None and i not in leaving:
        reserve += self.pages.shortfall(i, self.kept(s.seq_len, s.handle))
    return reserve

  def take(
    self, slots: list[int], members: list[RequestHandle], reserve: int, busy: bool
  ) -> Optional[tuple[list[int], int]]:
    """Admits a group when the pool has the pages its prompt and first tick reach, beside the
    reserve kept for the running rows and for the ones admitted before it (when `busy`)."""
    first = self.first_pages(members)
    # Pages its rows will want past their first tick, kept from later admissions.
    later = len(members) * max(
      self.pages.pages_for(self.kept(len(members[0].row_prompt()) + 1, members[0]))
      - self.pages.pages_for(first[0]),
      0,
    )
    if first[2] + (reserve + later if busy else 0) > self.pages.free:
      return None
    return self._take_pages(slots, first), later

  def _take_pages(self, slots: list[int], first: FirstPages) -> list[int]:
    """The first tick's pages of newly admitted rows, which the pool has (`take` checked):
    the first row holds the cached pages its prompt starts with, the other choices of a group
    share the first one's full prompt pages. Returns the cached pages."""
    reach, shared, _, hits = first
    self.pages.attach(slots[0], hits)
    for i, slot in enumerate(slots):
      if i:
        self.pages.share(slot, slots[0], shared)
      grown = self.pages.grow(slot, reach)
      assert grown, "the caller checked the pool's free pages"
    return hits

  def seated(self, slot: int, prompt: list[int], hits: list[int]) -> int:
    """Its full prompt pages serve later prompts (prefix_cache)."""
    self.pages.register(slot, prompt)
    return len(hits) * self.pages.page_size

  def page_table(self) -> Optional[list]:
    return self.pages.table().tolist()

  def held(self, slot: int) -> Optional[int]:
    return len(self.pages.pages(slot)) * self.pages.page_size

  def release(self, slot: int) -> None:
    self.pages.release(slot)

  def finished(self, slot: int, handle: RequestHandle, reason: str) -> None:
    """Its pages go back; a measured reserve moves toward the share of max_tokens it used."""
    self.pages.release(slot)
    if self._measure and reason in ("stop", "length"):
      # The share of its max_tokens it used: a running mean over about 8 requests.
      used = len(handle.generated) / max(handle.options.max_tokens, 1)
      self.reserve_ratio += (min(used, 1.0) - self.reserve_ratio) / 8

  def preempted(self) -> None:
    """A measured admission reserve was too small: it goes halfway to 1."""
    if self._measure:
      self.reserve_ratio = (1.0 + self.reserve_ratio) / 2

  def metrics(self) -> dict[str, float]:
    return {
      "admission_reserve": self.reserve_ratio,
      "kv_pages": self.pages.num_pages,
      "kv_pages_used": self.pages.used,
      "prefix_cache_pages": self.pages.cached,
      "prefix_cache_evictions_total": self.pages.evictions,
    }
