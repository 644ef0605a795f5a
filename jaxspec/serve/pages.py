"""Which pool pages each server row owns: the host side of paged K/V (state/paged.py).

The engine's paged K/V (`EngineConfig.page_size`) keeps every full-attention layer's K/V in a
pool of `num_pages` pages; each row reads and writes through its page table. `PageAllocator`
decides those tables on the host: a row gets the pages its text will reach before the next
read-back (the scheduler asks `grow` each tick) and gives them back when its request ends.
A page written by a row belongs to that row alone; full pages of a prompt may be shared
read-only by the rows that sample it (`share`, for `n` > 1: no row writes below its prompt's
end), and go back to the pool when the last of them releases them. The scheduler sends the
tables to the engine (`SpecEngine.set_page_table`) before any step that depends on them.
"""

from __future__ import annotations

import heapq

import numpy as np

from jaxspec.errors import ConfigError


class PageAllocator:
  """Pages of one pool, handed to rows in page-sized steps (lowest free ids first).

  Args:
    num_pages: pages in the pool (ids 0 .. num_pages − 1; `num_pages` itself means none).
    page_size: positions per page.
    rows: the engine's rows (slots).
    pages_per_row: the page table's width (max_len / page_size).
  """

  def __init__(self, num_pages: int, page_size: int, rows: int, pages_per_row: int):
    if min(num_pages, page_size, rows, pages_per_row) < 1 or num_pages < pages_per_row:
      raise ConfigError(
        f"a pool of {num_pages} pages cannot serve rows of {pages_per_row} pages of {page_size}"
      )
    self.num_pages, self.page_size = num_pages, page_size
    self.pages_per_row = pages_per_row
    self._free = list(range(num_pages))  # a heap: the lowest id first, so runs are repeatable
    self._rows: list[list[int]] = [[] for _ in range(rows)]
    self._holders = [0] * num_pages  # rows holding each page

  @property
  def free(self) -> int:
    """Pages nobody holds."""
    return len(self._free)

  @property
  def used(self) -> int:
    return self.num_pages - len(self._free)

  def pages(self, slot: int) -> list[int]:
    """The pages row `slot` holds, in position order."""
    return list(self._rows[slot])

  def pages_for(self, positions: int) -> int:
    """Pages that hold `positions` positions (at most a whole row's)."""
    return min(-(-max(positions, 0) // self.page_size), self.pages_per_row)

  def shortfall(self, slot: int, positions: int) -> int:
    """Pages row `slot` still needs to hold `positions` positions."""
    return max(self.pages_for(positions) - len(self._rows[slot]), 0)

  def grow(self, slot: int, positions: int) -> bool:
    """Gives row `slot` the pages it lacks to hold `positions` positions; False (and nothing
    given) if the pool has too few free pages."""
    need = self.shortfall(slot, positions)
    if need > len(self._free):
      return False
    pages = [heapq.heappop(self._free) for _ in range(need)]
    for p in pages:
      self._holders[p] = 1
    self._rows[slot] += pages
    return True

  def share(self, slot: int, source: int, pages: int) -> None:
    """Row `slot` (holding nothing) also holds the first `pages` pages of row `source`: full
    prompt pages, which neither row writes again."""
    if self._rows[slot] or pages > len(self._rows[source]):
      raise ValueError(f"share: row {slot} holds pages, or row {source} has fewer than {pages}")
    shared = self._rows[source][:pages]
    for p in shared:
      self._holders[p] += 1
    self._rows[slot] = list(shared)

  def release(self, slot: int) -> int:
    """Row `slot` lets go of its pages; those no other row holds return to the pool. Returns
    how many pages the row held."""
    pages, self._rows[slot] = self._rows[slot], []
    for p in pages:
      self._holders[p] -= 1
      if not self._holders[p]:
        heapq.heappush(self._free, p)
    return len(pages)

  def table(self) -> np.ndarray:
    """The page tables [rows, pages_per_row] (int32; `num_pages` where a row has no page)."""
    table = np.full((len(self._rows), self.pages_per_row), self.num_pages, np.int32)
    for slot, pages in enumerate(self._rows):
      table[slot, : len(pages)] = pages
    return table
