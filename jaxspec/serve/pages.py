"""Which pool pages each server row owns: the host side of paged K/V (state/paged.py).

The engine's paged K/V (`EngineConfig.page_size`) keeps every full-attention layer's K/V (MLA:
latents and indexer keys) in a pool of `num_pages` pages; each row reads and writes through
its page table. `PageAllocator`
decides those tables on the host: a row gets the pages its text will reach before the next
read-back (the scheduler asks `grow` each tick) and gives them back when its request ends.
A page written by a row belongs to that row alone; full pages of a prompt may be shared
read-only by the rows that sample it (`share`, for `n` > 1: no row writes below its prompt's
end), and go back to the pool when the last of them releases them. The scheduler sends the
tables to the engine (`SpecEngine.set_page_table`) before any step that depends on them.

With `prefix_cache`, the full pages of every prefilled prompt are kept after their rows end,
keyed by a hash of all the tokens up to their end (`register`): a later prompt that starts
with the same tokens holds them instead of recomputing them (`lookup`, `attach`; the engine's
`prefill_cached` reads them). The cache holds each of its pages once; a page that no row holds
counts as free, and when the pool has no other free page the least recently released cached
page is evicted (a prompt's later pages before its earlier ones).
"""

from __future__ import annotations

import collections
import hashlib
import heapq
from typing import Sequence

import numpy as np

from jaxspec.errors import ConfigError

KEYS_MEMO = 16  # prompts whose page keys `page_keys` keeps (the queue's head, the admitted)


class PageAllocator:
  """Pages of one pool, handed to rows in page-sized steps (lowest free ids first).

  Args:
    num_pages: pages in the pool (ids 0 .. num_pages − 1; `num_pages` itself means none).
    page_size: positions per page.
    rows: the engine's rows (slots).
    pages_per_row: the page table's width (max_len / page_size).
    prefix_cache: keep prompts' full pages for later prompts that start with them.
  """

  def __init__(
    self,
    num_pages: int,
    page_size: int,
    rows: int,
    pages_per_row: int,
    prefix_cache: bool = False,
  ):
    if min(num_pages, page_size, rows, pages_per_row) < 1 or num_pages < pages_per_row:
      raise ConfigError(
        f"a pool of {num_pages} pages cannot serve rows of {pages_per_row} pages of {page_size}"
      )
    self.num_pages, self.page_size = num_pages, page_size
    self.pages_per_row = pages_per_row
    self._free = list(range(num_pages))  # a heap: the lowest id first, so runs are repeatable
    self._rows: list[list[int]] = [[] for _ in range(rows)]
    self._holders = [0] * num_pages  # rows (and the prefix cache) holding each page
    self.prefix_cache = prefix_cache
    self._cached: dict[bytes, int] = {}  # prefix key → page
    self._key_of: dict[int, bytes] = {}  # page → prefix key
    # Cached pages no row holds, least recently released first: free to evict.
    self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()
    self.evictions = 0
    self._keys_memo: collections.OrderedDict[bytes, list[bytes]] = collections.OrderedDict()

  @property
  def free(self) -> int:
    """Pages no row holds (cached ones among them are evicted when needed)."""
    return len(self._free) + len(self._idle)

  @property
  def used(self) -> int:
    return self.num_pages - self.free

  @property
  def cached(self) -> int:
    """Pages the prefix cache keeps."""
    return len(self._cached)

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
    if need > self.free:
      return False
    pages = [self._take() for _ in range(need)]
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
    """Row `slot` lets go of its pages; those no other row holds return to the pool (cached
    ones stay cached, evictable, its later pages ahead of its earlier ones). Returns how many
    pages the row held."""
    pages, self._rows[slot] = self._rows[slot], []
    for p in reversed(pages):
      self._holders[p] -= 1
      if not self._holders[p]:
        heapq.heappush(self._free, p)
      elif self._holders[p] == 1 and p in self._key_of:
        self._idle[p] = None  # only the cache holds it: the most recently released
    return len(pages)

  def idle(self, page: int) -> bool:
    """Whether `page` is cached and no row holds it (it counts as free)."""
    return page in self._idle

  def _take(self) -> int:
    """A page for a row: the lowest free id, else the least recently released cached page."""
    if self._free:
      return heapq.heappop(self._free)
    page, _ = self._idle.popitem(last=False)
    del self._cached[self._key_of.pop(page)]
    self._holders[page] = 0
    self.evictions += 1
    return page

  def page_keys(self, tokens: Sequence[int]) -> list[bytes]:
    """The prefix key of each full page of `tokens`: a hash of every token up to its end
    (page j's key chains page j − 1's with the page's tokens as 4-byte little-endian ints).

    The scheduler asks again for the prompt at the head of the queue every tick while it
    waits for pages, and at `register`: the last prompts' keys are kept, found by their bytes.
    """
    data = np.asarray(tokens, np.int64).astype("<u4").tobytes()
    if data in self._keys_memo:
      self._keys_memo.move_to_end(data)
      return list(self._keys_memo[data])
    keys, key, step = [], b"", 4 * self.page_size
    for j in range(len(data) // step):
      key = hashlib.blake2b(key + data[j * step : (j + 1) * step]).digest()
      keys.append(key)
    self._keys_memo[data] = keys
    if len(self._keys_memo) > KEYS_MEMO:
      self._keys_memo.popitem(last=False)
    return list(keys)

  def lookup(self, tokens: Sequence[int]) -> list[int]:
    """The cached pages that hold the longest run of `tokens`' first full pages, leaving at
    least its last token to compute (its logits start the generation)."""
    if not self.prefix_cache:
      return []
    hits = []
    for key in self.page_keys(tokens[: len(tokens) - 1]):
      if key not in self._cached:
        break
      hits.append(self._cached[key])
    return hits

  def attach(self, slot: int, pages: Sequence[int]) -> None:
    """Row `slot` (holding nothing) holds cached `pages` (`lookup`) as its first pages."""
    if self._rows[slot]:
      raise ValueError(f"attach: row {slot} holds pages already")
    for p in pages:
      if p not in self._key_of:
        raise ValueError(f"attach: page {p} is not cached")
      self._holders[p] += 1
      self._idle.pop(p, None)
    self._rows[slot] = list(pages)

  def register(self, slot: int, tokens: Sequence[int]) -> int:
    """Caches row `slot`'s full pages of `tokens` (its prompt, whose K/V it prefilled there;
    it never writes them again) that the cache lacks. Returns how many pages were added."""
    if not self.prefix_cache:
      return 0
    added = 0
    for page, key in zip(self._rows[slot], self.page_keys(tokens)):
      if key in self._cached or page in self._key_of:
        continue
      self._cached[key], self._key_of[page] = page, key
      self._holders[page] += 1  # the cache's hold
      added += 1
    return added

  def table(self) -> np.ndarray:
    """The page tables [rows, pages_per_row] (int32; `num_pages` where a row has no page)."""
    table = np.full((len(self._rows), self.pages_per_row), self.num_pages, np.int32)
    for slot, pages in enumerate(self._rows):
      table[slot, : len(pages)] = pages
    return table
