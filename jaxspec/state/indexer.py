"""The lightning indexer's key cache of DeepSeek Sparse Attention (models/dsa.py).

One small key per token and layer (index_head_dim values, no heads, no values): the indexer
scores every committed slot against each block query to choose the keys its attention keeps.
Slot s holds position s, as in the full-length K/V kinds.
"""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.state.base import Kind, block_slots, move_path, put_slots, read_slots, take_slots

INDEXER_AXES = ("layers", "batch", "length", "head_dim")


@flax.struct.dataclass
class IndexerKeys(Kind):
  """The indexer's keys of one segment: k [L, B, S, index_head_dim] in `config.dtype`."""

  k: jax.Array

  format: ClassVar[str] = "indexer"
  AXES: ClassVar[dict] = {"k": INDEXER_AXES}

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "IndexerKeys":
    """A zero cache of `max_len` slots for `num_layers` layers and `batch` rows."""
    shape = (num_layers, batch, max_len, config.index_head_dim)
    return cls(jnp.zeros(shape, jnp.dtype(config.dtype)))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(
    self, layer: jax.Array, start: jax.Array, k: jax.Array
  ) -> tuple["IndexerKeys", jax.Array]:
    """A block's keys k [B, T, D] at slots start[b].. of `layer` → (entry, k as stored), so the
    block scores its own keys exactly as later queries will read them."""
    return self.put(layer, *block_slots(start, k.shape[1]), k)

  def put(
    self, layer: jax.Array, rows: jax.Array, slots: jax.Array, k: jax.Array
  ) -> tuple["IndexerKeys", jax.Array]:
    """As `write`, at explicit rows and slots [B, T] (out of range: dropped): a paged pool's
    pages (state/paged.py)."""
    k = k.astype(self.k.dtype)
    return self.replace(k=put_slots(self.k, layer, rows, slots, k)), k

  def take(self, layer: jax.Array, rows: jax.Array, slots: jax.Array) -> jax.Array:
    """Keys [B, T, D] at explicit rows and slots [B, T] (out of range: zeros)."""
    return take_slots(self.k, layer, rows, slots)

  def read(self, layer: jax.Array, offset: jax.Array | int, size: int) -> jax.Array:
    """Keys [B, size, D] of slots offset..offset+size−1 of `layer` (offset clamped to fit)."""
    return read_slots(self.k, layer, offset, size)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "IndexerKeys":
    """Slot start+j ← slot start+path[b, j] in every layer (the accepted tree path)."""
    return self.replace(k=move_path(self.k, start, path))
