"""The protocol's shared pieces: logical axis names, `KVChunk`, the defaults of `Kind` and the
slot arithmetic of stacked [L, B, S, ...] entries (see jaxspec/state/__init__.py)."""

from __future__ import annotations

from typing import ClassVar, NamedTuple, Optional

import jax
import jax.numpy as jnp

# Logical axes of an attention entry's K/V arrays (and Q4_0 scales, one per block of head_dim),
# of the FP8 scales, of a ring's slot positions and of per-row vectors (for sharding rules).
KV_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")
SCALE_AXES = ("layers", "batch", "length", "kv_heads")
POS_AXES = ("layers", "batch", "length")
ROW_AXES = ("batch",)

RING_EMPTY = -1  # the position of a ring slot nothing has been written to
NO_LIMIT = 2**31 - 1


class KVChunk(NamedTuple):
  """What attention reads of `size` slots of one layer (`read_chunk`).

  k [B, S, K, D] and v [B, S, K, Dv] as float values (dequantized), positions [B, S] int32 the
  position each slot holds, visible [B, S] bool whether a block at the reader's `start` may
  see the slot (it holds a position before the block, at or above the kind's floor).
  """

  k: jax.Array
  v: jax.Array
  positions: jax.Array
  visible: jax.Array


class Kind:
  """The protocol's defaults (see the module docstring): what a kind that has nothing to do
  for a question answers."""

  kv_format: ClassVar[Optional[str]] = None  # the `EngineConfig.kv_format` it stores, if any
  # Whether slot s holds position s for every position up to max_len (else: a ring of recent
  # positions, whose max_len is its slot count, not a bound on the text).
  holds_every_position: ClassVar[bool] = True

  def reads_after_write(self, t: int) -> bool:
    """Whether a block of t tokens may read the entry after writing it (attention then reads
    the written entry, which spares a copy); a ring whose writes could displace keys the
    block's own queries need says no, and is read as it was before the write."""
    del t
    return True

  def begin_block(self, start: jax.Array, t: int, keep: bool):
    """The entry ready for a block of t tokens at `start` (attention kinds: scratch slots)."""
    del start, t, keep
    return self

  def committed(self, lengths: jax.Array):
    """The entry once `lengths` tokens are committed (attention kinds: slots < lengths)."""
    del lengths
    return self

  def with_bounds(self, floor: jax.Array | None = None, limit: jax.Array | None = None):
    """A ring's read floor / write limit; a kind holding every position has none."""
    del floor, limit
    return self

  def with_table(self, table: jax.Array):
    """The entry with new page tables [B, W] (paged kinds, state/paged.py; others: itself)."""
    del table
    return self

  def adopt_row(self, slot: jax.Array, row):
    """Before a one-row entry `row` is spliced into row `slot` (`SpecEngine.insert`): what
    rows share (a paged kind's pool) takes the row's content → (entry, row as spliced)."""
    del slot
    return self, row

  def load_pages(self, source, pages: jax.Array):
    """Each row's logical page j ← page pages[b, j] of `source`'s pool (paged kinds: a cached
    prompt prefix; others: itself)."""
    del source, pages
    return self

  @property
  def paged_part(self):
    """The paged entry (state/paged.py) holding this entry's page table when all of its
    storage is in pages, else None: what the state's page questions are asked of."""
    return None

  def kernel_operands(self) -> dict | None:
    """The stored arrays the Pallas tree-attention kernel reads, or None (it cannot)."""
    return None


def block_slots(start: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  rows = jnp.arange(start.shape[0])[:, None]
  return rows, start[:, None] + jnp.arange(width)[None, :]


def read_slots(x: jax.Array, layer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
  """x[layer, :, offset:offset+size] (offset is clamped by dynamic_slice to fit)."""
  zeros = (0,) * (x.ndim - 3)
  return jax.lax.dynamic_slice(x, (layer, 0, offset, *zeros), (1, x.shape[1], size, *x.shape[3:]))[
    0
  ]


def put_slots(
  x: jax.Array, layer: jax.Array, rows: jax.Array, slots: jax.Array, block: jax.Array
) -> jax.Array:
  """x [L, N, S, ...] ← block [B, T, ...] at explicit rows and slots [B, T] of `layer` (a row
  or slot out of range: dropped); rows are a pool's pages for paged kinds (state/paged.py)."""
  return x.at[layer, rows, slots].set(block.astype(x.dtype), mode="drop")


def take_slots(x: jax.Array, layer: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
  """x[layer, rows, slots] for rows, slots [B, T] (out of range: zeros); `put_slots`' inverse."""
  return x.at[layer, rows, slots].get(mode="fill", fill_value=0)


def move_path(x: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
  """Slot start+j ← slot start+path[b, j] in every layer (x [L, B, S, ...])."""
  rows = jnp.arange(path.shape[0])[:, None]
  picked = x[:, rows, start[:, None] + path]
  _, to_slots = block_slots(start, path.shape[1])
  return x.at[:, rows, to_slots].set(picked, mode="drop")
