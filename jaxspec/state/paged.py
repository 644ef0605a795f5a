"""The paged kind: full-length storage in fixed-size pages of one pool that every row shares.

A contiguous cache (state/kv.py) reserves max_len slots per row whether the row holds 50
positions or 50,000. `PagedKV` stores a full-length kind's arrays in a pool of P pages of
`page_size` slots, quantized exactly as that kind stores them, and gives each row a page table
[B, max_len / page_size]: logical slot s of row b lives in slot s mod page_size of pool page
table[b, s // page_size]. Positions stay identity (slot s holds position s), so attention,
verify blocks and tree commits use it as any full-length kind; only `write`, `read_chunk` and
`commit_path` go through the table.

What it pages: attention K/V (float, FP8, Q4_0), MLA's latent vectors (state/latent.py, in the
same three formats) and DSA's indexer keys (state/indexer.py). The pooled kind answers `put`
(a block at explicit pages and slots) and `take` (its inverse); `write` and `read` return what
the kind's own `write` and `read` return (K and V; a latent and its value part; keys).

Who owns which page is the host's business (serve/pages.py allocates them and sets the tables
with `with_table`): a table entry equal to P (`unmapped`) names no page, so a write there is
dropped and a read there gives zeros, and a row whose pages were freed cannot touch pages
given to another. The engine's own `generate` gives row b pages b·W .. b·W + W − 1 (W pages per
row), the same memory as a contiguous cache.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.errors import ConfigError
from jaxspec.state.kv import FullLengthKV

# Logical axes of a pool array [L, P, page, ...]: pages are shared by rows (no batch axis).
PAGE_TABLE_AXES = ("batch", None)


def _pool_axes(axes: dict) -> dict:
  """A full-length kind's AXES with its batch axis read as pages and its length as a page."""
  return {name: ("layers", "pages", None, *names[3:]) for name, names in axes.items()}


_POOL_KINDS: dict[type, type] = {}


def pool_kind(kind: type) -> type:
  """`kind` (a full-length kind with `put` and `take`) whose [L, B, S, ...] arrays are read as
  [L, P, page, ...]: one class per kind, so pooled states of the same kind share a treedef."""
  if kind not in _POOL_KINDS:
    if not (hasattr(kind, "put") and hasattr(kind, "take")):
      raise ConfigError(f"{kind.__name__} cannot be paged: it has no put / take")
    cls = type(f"Pooled{kind.__name__}", (kind,), {"AXES": _pool_axes(kind.AXES)})
    cls.__module__ = __name__
    _POOL_KINDS[kind] = flax.struct.dataclass(cls)
  return _POOL_KINDS[kind]


def page_slots(table: jax.Array, slots: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array]:
  """Logical slots [B, T] of the rows of `table` → (pool pages [B, T], slots in the page)."""
  pages = jnp.take_along_axis(table, jnp.clip(slots // page_size, 0, table.shape[1] - 1), axis=1)
  return pages, slots % page_size


@flax.struct.dataclass
class PagedKV(FullLengthKV):
  """One layer run's full-length storage (K/V, latents or indexer keys) in pages of a shared
  pool.

  Attributes:
    pool: a `pool_kind` entry: its arrays are [L, P, page_size, ...] (P pages).
    table: int32 [B, W]: the pool page of each row's W logical pages; P = unmapped.
  """

  pool: Any
  table: jax.Array

  AXES: ClassVar[dict] = {"table": PAGE_TABLE_AXES}  # the pool names its own

  @classmethod
  def create(
    cls,
    kind: type,
    config: Any,
    num_layers: int,
    batch: int,
    max_len: int,
    page_size: int,
    num_pages: int | None = None,
  ) -> "PagedKV":
    """A zero pool of `num_pages` pages (None: batch · max_len / page_size) of `kind`'s
    storage (a full-length kind: `FloatKV`, `LatentFP8`, `IndexerKeys`, ...); rows own
    consecutive pages while the pool has enough (else: unmapped)."""
    if max_len % page_size:
      raise ConfigError(f"max_len={max_len} is not a multiple of page_size={page_size}")
    width = max_len // page_size
    num_pages = batch * width if num_pages is None else num_pages
    pool = pool_kind(kind).create(config, num_layers, num_pages, page_size)
    return cls(pool, identity_table(batch, width, num_pages))

  @property
  def format(self) -> str:
    return f"paged {self.pool.format}"

  @property
  def kv_format(self) -> str | None:
    return self.pool.kv_format

  @property
  def paged_part(self) -> "PagedKV":
    return self

  @property
  def page_size(self) -> int:
    return self.pool.max_len

  @property
  def num_pages(self) -> int:
    return jax.tree_util.tree_leaves(self.pool)[0].shape[1]

  @property
  def max_len(self) -> int:
    return self.table.shape[1] * self.page_size

  def with_table(self, table: jax.Array) -> "PagedKV":
    """The entry with new page tables [B, W] (entries ≥ P: unmapped)."""
    return self.replace(table=jnp.asarray(table, jnp.int32).reshape(self.table.shape))

  def _locate(self, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    return page_slots(self.table, slots, self.page_size)

  def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, *rest: Any):
    """A block [B, T, ...] (and the kind's other operands: v for K/V) at logical slots
    start[b].. → (entry, what the kind's `write` returns after it: the block as stored)."""
    slots = start[:, None] + jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    pages, offsets = self._locate(slots)
    pages = jnp.where(slots < self.max_len, pages, self.num_pages)  # past max_len: dropped
    pool, *stored = self.pool.put(layer, pages, offsets, k, *rest)
    return (self.replace(pool=pool), *stored)

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> Any:
    """What the kind's `read` gives (K/V as float values: k, v) of logical slots
    offset..offset+size−1 of every row (clamped to fit, as a contiguous cache's `read` is);
    unmapped pages read as zeros."""
    offset = jnp.clip(offset, 0, self.max_len - size)
    slots = offset + jnp.arange(size, dtype=jnp.int32)
    slots = jnp.broadcast_to(slots, (self.table.shape[0], size))
    return self.pool.take(layer, *self._locate(slots))

  def commit_path(self, start: jax.Array, path: jax.Array) -> "PagedKV":
    """Slot start+j ← slot start+path[b, j] in every layer, through the table."""
    src = self._locate(start[:, None] + path)
    dst = self._locate(start[:, None] + jnp.arange(path.shape[1], dtype=jnp.int32)[None, :])
    move = lambda x: x.at[:, dst[0], dst[1]].set(x[:, src[0], src[1]], mode="drop")
    return self.replace(pool=jax.tree_util.tree_map(move, self.pool))

  def adopt_row(self, slot: jax.Array, row: "PagedKV") -> tuple["PagedKV", "PagedKV"]:
    """A one-row entry's pages copied into this entry's pool at row `slot`'s pages (those the
    table maps; the rest dropped): (entry, the row as it now stands in this entry)."""
    if row.table.shape != (1, self.table.shape[1]) or row.page_size != self.page_size:
      raise ConfigError("adopt_row: the row's page geometry differs from the entry's")
    table = jnp.take(self.table, slot, axis=0)
    # A page the row does not map (a cached prefix page it only read) is not copied.
    copy = lambda x, r: copy_pages(x, table, r, row.table[0], axis=1)
    pool = jax.tree_util.tree_map(copy, self.pool, row.pool)
    return self.replace(pool=pool), row.replace(table=table[None], pool=pool)

  def load_pages(self, source: "PagedKV", pages: jax.Array) -> "PagedKV":
    """Each row's logical page j ← page pages[b, j] of `source`'s pool (a cached prefix, read
    before a prefill continues after it); entries ≥ source's page count load nothing."""
    src, dst = jnp.asarray(pages, jnp.int32).reshape(-1), self.table.reshape(-1)
    copy = lambda x, s: copy_pages(x, dst, s, src, axis=1)
    return self.replace(pool=jax.tree_util.tree_map(copy, self.pool, source.pool))

  def kernel_operands(self) -> dict | None:
    """The pool's operands and the page table: the Pallas kernel reads the pages in place
    when they hold a power of two ≥ 16 slots (its tile never crosses a page); None otherwise,
    and for storage it does not read (Q4_0)."""
    ops, size = self.pool.kernel_operands(), self.page_size
    if ops is None or size < 16 or size & (size - 1):
      return None
    return dict(ops, page_table=self.table)


def copy_pages(
  into: jax.Array, into_pages: jax.Array, source: jax.Array, source_pages: jax.Array, axis: int
) -> jax.Array:
  """`into` with its pages into_pages [N] ← `source`'s pages source_pages [N], pages along
  `axis` of both; a source id past source's pages (unmapped) copies nothing, as does a
  destination id past into's."""
  dst = jnp.where(source_pages < source.shape[axis], into_pages, into.shape[axis])
  values = jnp.take(source, source_pages, axis=axis, mode="clip").astype(into.dtype)
  return into.at[(slice(None),) * axis + (dst,)].set(values, mode="drop")


def identity_table(batch: int, width: int, num_pages: int) -> jax.Array:
  """Row b → pages b·W .. b·W + W − 1 where the pool has them, else unmapped (= num_pages)."""
  table = jnp.arange(batch * width, dtype=jnp.int32).reshape(batch, width)
  return jnp.where(table < num_pages, table, num_pages)
