"""The KV cache: an explicit pytree passed into and returned from every forward.

Layout: k, v of shape [layers, batch, max_len, kv_heads, head_dim] (logical axes `layers, batch,
length, kv_heads, head_dim`) plus per-sequence committed lengths [batch]. A forward writes a
block of T entries at slots lengths..lengths+T-1 without committing them; `commit` advances the
lengths by what was accepted; `gather_block` moves selected block entries (an accepted tree path)
into contiguous slots first. Slots at or past `lengths` are scratch: never read as prefix.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

CACHE_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")


@flax.struct.dataclass
class KVCache:
  k: jax.Array
  v: jax.Array
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  @property
  def batch(self) -> int:
    return self.k.shape[1]

  @classmethod
  def create(
    cls,
    num_layers: int,
    batch: int,
    max_len: int,
    kv_heads: int,
    head_dim: int,
    dtype: jnp.dtype = jnp.float32,
  ) -> "KVCache":
    shape = (num_layers, batch, max_len, kv_heads, head_dim)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch,), jnp.int32))

  @classmethod
  def for_model(
    cls,
    config,
    batch: int,
    max_len: int,
    num_layers: int | None = None,
    dtype: jnp.dtype | None = None,
  ) -> "KVCache":
    """A zero cache shaped for a ModelConfig (num_layers defaults to the main stack)."""
    return cls.create(
      config.num_layers if num_layers is None else num_layers,
      batch,
      max_len,
      config.num_kv_heads,
      config.head_dim,
      jnp.dtype(config.dtype) if dtype is None else dtype,
    )

  def commit(self, num_new: jax.Array) -> "KVCache":
    """Advances each sequence's committed length by num_new [B]."""
    return self.replace(lengths=self.lengths + num_new.astype(jnp.int32))

  def gather_block(self, src: jax.Array) -> "KVCache":
    """Moves block entries into place: slot len+j ← slot len+src[b, j], for j < src.shape[1].

    Tree verification writes N nodes at slots len..len+N-1; the accepted path (node indices
    src, root first) is compacted to len..len+a. Entries past the accepted count are scratch.
    """
    b, n = src.shape
    rows = jnp.arange(b)[:, None]
    from_slots = self.lengths[:, None] + src
    to_slots = self.lengths[:, None] + jnp.arange(n)[None, :]

    def move(x):
      picked = x[:, rows, from_slots]  # [L, B, n, K, D]
      return x.at[:, rows, to_slots].set(picked, mode="drop")

    return self.replace(k=move(self.k), v=move(self.v))

  def valid_mask(self) -> jax.Array:
    """[B, max_len] bool: slots holding committed entries."""
    return jnp.arange(self.max_len)[None, :] < self.lengths[:, None]
