"""Ring kinds: the most recent positions in C slots (slot = position mod C), each slot's
position recorded and reads made by stored position."""

from __future__ import annotations

from typing import ClassVar

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.state.base import (
  KV_AXES,
  NO_LIMIT,
  POS_AXES,
  RING_EMPTY,
  ROW_AXES,
  KVChunk,
  Kind,
  block_slots,
)
from jaxspec.state.kv import FloatKV


class _Ring(Kind):
  """What the ring kinds share: slot = position mod C, the position each slot holds recorded;
  a block wider than the ring, or than its write limit allows, keeps only its last C."""

  holds_every_position: ClassVar[bool] = False

  def read_range(self, start: jax.Array, lowest: jax.Array | None = None):
    """(lo, hi): every slot that can hold a position < start (all of them once wrapped); while
    no row has reached C, slot = position, so a window's lowest position bounds lo too."""
    cap, top = self.max_len, jnp.max(start)
    lo = 0 if lowest is None else jnp.where(top <= cap, jnp.clip(lowest, 0, cap), 0)
    return lo, jnp.minimum(top, cap)


def _ring_slots(start: jax.Array, t: int, cap: int, limit: jax.Array):
  """(rows, positions [B, t], slots [B, t]) of a block at `start`: positions ≥ limit and all
  but the last C below it go to slot C (out of range: dropped)."""
  rows, positions = block_slots(start, t)
  end = jnp.minimum(start + t, limit)[:, None]
  keep = (positions < limit[:, None]) & (positions >= end - cap)
  return rows, positions, jnp.where(keep, positions % cap, cap)


def _ring_path(start: jax.Array, path: jax.Array, cap: int, limit: jax.Array):
  """(rows, source positions, source slots, target positions, target slots) of moving the
  path's nodes (written at start + path) to start..start+n−1 (targets past the limit, or not
  among the last C, dropped)."""
  rows, to_pos = block_slots(start, path.shape[1])
  from_pos = start[:, None] + path
  keep = (to_pos < limit[:, None]) & (to_pos >= start[:, None] + path.shape[1] - cap)
  return rows, from_pos, from_pos % cap, to_pos, jnp.where(keep, to_pos % cap, cap)


def _ring_move(x: jax.Array, rows: jax.Array, src: jax.Array, dst: jax.Array) -> jax.Array:
  """Slot dst ← slot src in every layer of x [L, B, C, ...] (dst = C dropped)."""
  return x.at[:, rows, dst].set(x[:, rows, src], mode="drop")


@flax.struct.dataclass
class RingKV(_Ring):
  """Float K/V of the most recent positions only: k, v [L, B, C, K, D] in a ring of C slots
  (slot = position mod C), with the position each slot holds, pos [L, B, C] (−1 = empty).

  Reads are by stored position, not by slot: a query block at `start` sees the slots whose
  position p satisfies floor ≤ p < start. `floor` [B] and `limit` [B] are the bounds the owner
  sets before a forward (`with_bounds`): a write stores only positions < limit (prompt padding
  must not displace live entries) and, of a block wider than the ring, only its last C. A ring
  of C = N + w slots keeps the N positions before a root intact while blocks of up to w
  positions are written at or after it, so a reader that sets floor = root − N sees exactly
  the N most recent entries before its root (and what it wrote since), however long the text.
  """

  k: jax.Array
  v: jax.Array
  pos: jax.Array
  floor: jax.Array
  limit: jax.Array

  format: ClassVar[str] = "ring"
  AXES: ClassVar[dict] = {
    "k": KV_AXES,
    "v": KV_AXES,
    "pos": POS_AXES,
    "floor": ROW_AXES,
    "limit": ROW_AXES,
  }

  @classmethod
  def create(cls, config, num_layers: int, batch: int, capacity: int) -> "RingKV":
    kv = FloatKV.create(config, num_layers, batch, capacity)
    return cls(
      kv.k,
      kv.v,
      jnp.full((num_layers, batch, capacity), RING_EMPTY, jnp.int32),
      jnp.zeros((batch,), jnp.int32),
      jnp.full((batch,), NO_LIMIT, jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def with_bounds(self, floor: jax.Array | None = None, limit: jax.Array | None = None):
    """The ring with new read floor / write limit ([B] int32; None keeps the current one)."""
    floor = self.floor if floor is None else jnp.broadcast_to(floor, self.floor.shape)
    limit = self.limit if limit is None else jnp.broadcast_to(limit, self.limit.shape)
    return self.replace(floor=floor.astype(jnp.int32), limit=limit.astype(jnp.int32))

  def write(
    self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array
  ) -> tuple["RingKV", jax.Array, jax.Array]:
    rows, positions, slots = _ring_slots(start, k.shape[1], self.max_len, self.limit)
    k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
    put = lambda x, block: x.at[layer, rows, slots].set(block, mode="drop")
    return self.replace(k=put(self.k, k), v=put(self.v, v), pos=put(self.pos, positions)), k, v

  read = FloatKV.read

  def slot_positions(self, layer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
    """[B, size] positions held by slots offset..offset+size−1 of `layer`."""
    return jax.lax.dynamic_slice(self.pos, (layer, 0, offset), (1, self.pos.shape[1], size))[0]

  def read_chunk(self, layer: jax.Array, offset: jax.Array, size: int, start: jax.Array):
    k, v = self.read(layer, offset, size)
    pos = self.slot_positions(layer, offset, size)
    floor = jnp.maximum(self.floor, 0)[:, None]  # empty slots hold −1
    return KVChunk(k, v, pos, (pos >= floor) & (pos < start[:, None]))

  def commit_path(self, start: jax.Array, path: jax.Array) -> "RingKV":
    """The path's nodes moved to positions start..start+n−1 in their ring slots; a node the
    ring no longer holds (displaced by a block wider than the ring) leaves its target empty."""
    rows, from_pos, src, to_pos, dst = _ring_path(start, path, self.max_len, self.limit)
    held = self.pos[:, rows, src] == from_pos[None]  # [L, B, n]
    pos = jnp.where(held, to_pos[None], RING_EMPTY)
    return self.replace(
      k=_ring_move(self.k, rows, src, dst),
      v=_ring_move(self.v, rows, src, dst),
      pos=self.pos.at[:, rows, dst].set(pos, mode="drop"),
    )


@flax.struct.dataclass
class ContextRing(_Ring):
  """Float K/V of context positions for every layer of a stack: ctx_k, ctx_v [L, B, C, K, D]
  in a ring of C slots (slot = position mod C; C = max_len never wraps), with one position per
  slot shared by the layers, ctx_pos [B, C] (−1 = empty).

  Its owner writes all layers at once (`append`: DFlash's fused target features projected by
  each drafter layer); the blocks that read it never write it. A block at `start` sees the
  stored positions p with start − keep ≤ p < start (`keep` 0: every one), so a ring of
  C ≥ keep slots that its owner fills up to each reader's start reads as a sliding window.
  """

  ctx_k: jax.Array
  ctx_v: jax.Array
  ctx_pos: jax.Array
  keep: int = flax.struct.field(pytree_node=False, default=0)

  format: ClassVar[str] = "context_ring"
  AXES: ClassVar[dict] = {"ctx_k": KV_AXES, "ctx_v": KV_AXES, "ctx_pos": ("batch", "length")}

  @classmethod
  def create(
    cls, config, num_layers: int, batch: int, capacity: int, keep: int = 0
  ) -> "ContextRing":
    kv = FloatKV.create(config, num_layers, batch, capacity)
    return cls(kv.k, kv.v, jnp.full((batch, capacity), RING_EMPTY, jnp.int32), keep)

  @property
  def max_len(self) -> int:
    return self.ctx_k.shape[2]

  def append(
    self, start: jax.Array, k: jax.Array, v: jax.Array, limit: jax.Array
  ) -> "ContextRing":
    """Every layer's K/V k, v [L, B, T, K, D] of positions start..start+T−1, of which those
    < limit [B] are real (the last C of them kept)."""
    rows, positions, slots = _ring_slots(start, k.shape[2], self.max_len, limit)
    put = lambda x, block: x.at[:, rows, slots].set(block.astype(x.dtype), mode="drop")
    return self.replace(
      ctx_k=put(self.ctx_k, k),
      ctx_v=put(self.ctx_v, v),
      ctx_pos=self.ctx_pos.at[rows, slots].set(positions, mode="drop"),
    )

  def write(
    self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array
  ) -> tuple["ContextRing", jax.Array, jax.Array]:
    """One layer's block (the protocol's write; the shared positions are recorded too)."""
    limit = jnp.full(start.shape, NO_LIMIT, jnp.int32)
    rows, positions, slots = _ring_slots(start, k.shape[1], self.max_len, limit)
    k, v = k.astype(self.ctx_k.dtype), v.astype(self.ctx_v.dtype)
    put = lambda x, block: x.at[layer, rows, slots].set(block, mode="drop")
    entry = self.replace(
      ctx_k=put(self.ctx_k, k),
      ctx_v=put(self.ctx_v, v),
      ctx_pos=self.ctx_pos.at[rows, slots].set(positions, mode="drop"),
    )
    return entry, k, v

  def read_chunk(self, layer: jax.Array, offset: jax.Array, size: int, start: jax.Array):
    _, b, _, kv_heads, d = self.ctx_k.shape
    window, at = (1, b, size, kv_heads, d), (layer, 0, offset, 0, 0)
    k = jax.lax.dynamic_slice(self.ctx_k, at, window)[0]
    v = jax.lax.dynamic_slice(self.ctx_v, at, window)[0]
    pos = jax.lax.dynamic_slice_in_dim(self.ctx_pos, offset, size, axis=1)
    floor = jnp.maximum(start - self.keep, 0) if self.keep else jnp.zeros_like(start)
    return KVChunk(k, v, pos, (pos >= floor[:, None]) & (pos < start[:, None]))

  def commit_path(self, start: jax.Array, path: jax.Array) -> "ContextRing":
    """As RingKV.commit_path, the positions shared by the layers."""
    limit = jnp.full(start.shape, NO_LIMIT, jnp.int32)
    rows, from_pos, src, to_pos, dst = _ring_path(start, path, self.max_len, limit)
    pos = jnp.where(self.ctx_pos[rows, src] == from_pos, to_pos, RING_EMPTY)
    return self.replace(
      ctx_k=_ring_move(self.ctx_k, rows, src, dst),
      ctx_v=_ring_move(self.ctx_v, rows, src, dst),
      ctx_pos=self.ctx_pos.at[rows, dst].set(pos, mode="drop"),
    )
