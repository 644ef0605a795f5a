"""The sliding-window kind: a layer run whose attention window is W keeps the most recent
W + slack positions in a ring, in any of the full-length KV formats.

A sliding layer's query at position q sees keys p > q − W only, so a cache of every position
wastes (context − W) slots per layer: at 128K context and W = 128 that is 99.9% of a sliding
layer's cache. `SlidingKV` stores C = W + slack slots (slot = position mod C) in the storage of
a full-length kind (`FloatKV`, `FP8KV`, `Q4KV`: the values quantized exactly as those store
them), records the position each slot holds, and is read by stored position, so attention,
the engine and the drafters use it as they use any kind (jaxspec/state/__init__.py).

Why W + slack: a speculative block of T ≤ slack tokens writes positions start..start+T−1,
displacing the slots of positions start+j−C ≤ start−W−1−(slack−T): none of them inside
any later query's window, so a block that is rejected in part never overwrites a position a
query still needs (rejected positions sit at or past the committed length, invisible, until a
later block rewrites them). The engine sets slack to its widest speculative block.

A block wider than the slack (a prefill chunk; it is accepted whole) would displace keys its
own first queries need, so such a block is read before it is written (`reads_after_write`):
its queries see the ring as it was, and the block's own keys through the block part of
attention. Padding past a prompt's end is never written (`limit`, set from the decoder's
`valid`), so a short prompt padded to a wide chunk keeps its window.
"""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.state.base import NO_LIMIT, POS_AXES, RING_EMPTY, ROW_AXES, KVChunk
from jaxspec.state.ring import _Ring, _ring_move, _ring_path, _ring_slots


@flax.struct.dataclass
class SlidingKV(_Ring):
  """K/V of a sliding-window layer run: `store` is a full-length kind (float, FP8 or Q4_0)
  of C = window + slack slots per layer, pos [L, B, C] the position each slot holds (−1 =
  empty) and limit [B] the first position a write may not store (prompt padding).

  Attributes:
    store: the storage, [L, B, C, ...] arrays in the chosen KV format.
    pos: int32 [L, B, C].
    limit: int32 [B], set by `with_bounds(limit=...)` before a forward (NO_LIMIT: none).
    window: the layers' window W (static).
  """

  store: Any
  pos: jax.Array
  limit: jax.Array
  window: int = flax.struct.field(pytree_node=False, default=0)

  AXES: ClassVar[dict] = {"pos": POS_AXES, "limit": ROW_AXES}  # the store names its own

  @classmethod
  def create(
    cls, kind: Any, config: Any, num_layers: int, batch: int, window: int, slack: int
  ) -> "SlidingKV":
    """A zero entry of `kind` (a full-length KV class) with window + slack slots."""
    capacity = window + slack
    return cls(
      kind.create(config, num_layers, batch, capacity),
      jnp.full((num_layers, batch, capacity), RING_EMPTY, jnp.int32),
      jnp.full((batch,), NO_LIMIT, jnp.int32),
      window,
    )

  @property
  def format(self) -> str:
    return f"sliding {self.store.format}"

  @property
  def kv_format(self) -> str:
    return self.store.kv_format

  @property
  def max_len(self) -> int:
    """Slots per layer (what a reader may visit); the positions held are unbounded."""
    return self.store.max_len

  @property
  def slack(self) -> int:
    return self.max_len - self.window

  def with_bounds(self, floor: jax.Array | None = None, limit: jax.Array | None = None):
    """The entry with a new write limit ([B]; None keeps it). The read floor is the window."""
    del floor
    if limit is None:
      return self
    return self.replace(limit=jnp.broadcast_to(limit, self.limit.shape).astype(jnp.int32))

  def reads_after_write(self, t: int) -> bool:
    """Whether a block of t tokens may read the entry after writing it: only while its writes
    cannot displace a key inside its own queries' windows."""
    return t <= self.slack

  def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array):
    """The block's K/V into its ring slots (only positions < limit, the last C of them);
    returns (entry, k, v as stored)."""
    rows, positions, slots = _ring_slots(start, k.shape[1], self.max_len, self.limit)
    store, k_stored, v_stored = self.store.put(layer, rows, slots, k, v)
    pos = self.pos.at[layer, rows, slots].set(positions, mode="drop")
    return self.replace(store=store, pos=pos), k_stored, v_stored

  def read_chunk(self, layer: jax.Array, offset: jax.Array, size: int, start: jax.Array):
    k, v = self.store.read(layer, offset, size)
    pos = jax.lax.dynamic_slice(self.pos, (layer, 0, offset), (1, self.pos.shape[1], size))[0]
    # Empty slots hold −1; a slot is visible if it holds a committed position (the window
    # itself is applied by attention, per query).
    return KVChunk(k, v, pos, (pos >= 0) & (pos < start[:, None]))

  def commit_path(self, start: jax.Array, path: jax.Array) -> "SlidingKV":
    """The accepted path's nodes (written at start + node) moved to start..start+n−1."""
    rows, from_pos, src, to_pos, dst = _ring_path(start, path, self.max_len, self.limit)
    held = self.pos[:, rows, src] == from_pos[None]  # [L, B, n]
    pos = jnp.where(held, to_pos[None], RING_EMPTY)
    store = jax.tree_util.tree_map(lambda x: _ring_move(x, rows, src, dst), self.store)
    return self.replace(store=store, pos=self.pos.at[:, rows, dst].set(pos, mode="drop"))

  def kernel_operands(self) -> None:
    """The Pallas kernel reads slot = position caches only."""
    return None
