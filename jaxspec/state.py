"""The decoding state a forward reads and writes: one entry per layer segment.

The decoder scans each maximal run of same-kind layers (`ModelConfig.segments()`); each run owns
one entry of `DecodingState.segments`, stacked over its layers (leading axis `layers`). An entry
is a *layer-state kind*, a pytree class that says how it is

  created      `Kind.create(config, num_layers, batch, max_len)`
  written      `write(layer, start, k, v)` → (entry, k, v as stored): a block of T tokens at
               slots start..start+T-1; the block attends to its own K/V exactly as later
               queries will read them, so chains, trees and plain decoding see the same values
  read         `read(layer, offset, size)`: float K/V of `size` slots from `offset` (attention
               reads the committed prefix chunk by chunk, dequantizing each chunk)
  committed    `commit_path(start, path)`: the accepted chain prefix or tree path, node indices
               root first, moved to slots start..start+a

Attention kinds keep the rule "slots at or past `lengths` are scratch": a block writes past the
committed length, and only the accepted prefix becomes part of the text when `lengths`
advances. The recurrent kind `LinearState` (Gated DeltaNet layers) fits the same seam: a block
leaves per-position snapshots and committing the new `lengths` keeps the accepted one; the
engine never looks inside an entry.

Kinds here: `FloatKV` (the activation dtype), `FP8KV` (E4M3 values with one float32 scale
per token and KV head, quantized on write) and `Q4KV` (llama.cpp's Q4_0); `KV_FORMATS` maps
`EngineConfig.kv_format` to them. `RingKV` keeps only the most recent positions in a ring of
slots, each with the position it holds (the drafters' long-context feature ring).

Logical axes: each kind's `AXES` table names the logical axis of every dimension of its arrays
(`layers`, `batch`, `length`, `kv_heads`, `head_dim`); `logical_axes` reads those tables for a
whole state pytree (the engine's, the drafters' states), so the state can be placed and kept on a
device mesh by the rules of jaxspec/sharding.py.
"""

from __future__ import annotations

from typing import Any, ClassVar, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxspec.errors import ConfigError
from jaxspec.quant.codecs import (
  Q4_BLOCK,
  fp8_bits,
  fp8_dequantize,
  fp8_quantize,
  fp8_values,
  q4_0_dequantize,
  q4_0_quantize,
)

# Logical axes of an attention entry's K/V arrays (and Q4_0 scales, one per block of head_dim),
# of the FP8 scales, of a ring's slot positions and of per-row vectors (for sharding rules).
KV_AXES = ("layers", "batch", "length", "kv_heads", "head_dim")
SCALE_AXES = ("layers", "batch", "length", "kv_heads")
# Logical axes of a LinearState's arrays, by field (conv channels and state dims unsharded).
LINEAR_STATE_AXES = {
  "conv": ("layers", "batch", None, None),
  "ssm": ("layers", "batch", None, None, None),
  "pending_conv": ("layers", "batch", None, None),
  "pending_ssm": ("layers", "batch", None, None, None, None),
  "pending_start": ("batch",),
}
POS_AXES = ("layers", "batch", "length")
ROW_AXES = ("batch",)




def _slots(start: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
  rows = jnp.arange(start.shape[0])[:, None]
  return rows, start[:, None] + jnp.arange(width)[None, :]


def _write(x: jax.Array, layer: jax.Array, start: jax.Array, block: jax.Array) -> jax.Array:
  """x [L, B, S, ...] ← block [B, T, ...] at layer `layer`, slots start[b]..; past S dropped."""
  rows, slots = _slots(start, block.shape[1])
  return x.at[layer, rows, slots].set(block.astype(x.dtype), mode="drop")


def _read(x: jax.Array, layer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
  """x[layer, :, offset:offset+size] (offset is clamped by dynamic_slice to fit)."""
  zeros = (0,) * (x.ndim - 3)
  return jax.lax.dynamic_slice(x, (layer, 0, offset, *zeros), (1, x.shape[1], size, *x.shape[3:]))[
    0
  ]


def _move(x: jax.Array, start: jax.Array, path: jax.Array) -> jax.Array:
  """Slot start+j ← slot start+path[b, j] in every layer (x [L, B, S, ...])."""
  rows = jnp.arange(path.shape[0])[:, None]
  picked = x[:, rows, start[:, None] + path]
  _, to_slots = _slots(start, path.shape[1])
  return x.at[:, rows, to_slots].set(picked, mode="drop")


@flax.struct.dataclass
class FloatKV:
  """Attention K/V of one segment in a float dtype: k, v [L, B, S, K, D]."""

  k: jax.Array
  v: jax.Array

  format: ClassVar[str] = "float"
  AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES}

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "FloatKV":
    shape = (num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    dtype = jnp.dtype(config.dtype)
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(
    self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array
  ) -> tuple["FloatKV", jax.Array, jax.Array]:
    k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
    return FloatKV(_write(self.k, layer, start, k), _write(self.v, layer, start, v)), k, v

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    return _read(self.k, layer, offset, size), _read(self.v, layer, offset, size)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "FloatKV":
    return FloatKV(_move(self.k, start, path), _move(self.v, start, path))


class _QuantizedKV:
  """What the quantized kinds share: K and V stored as `encode` makes them, beside their
  scales, written quantized once and read back through `decode` chunk by chunk.

  A subclass is a flax struct with fields k, v, k_scale, v_scale and dtype, and defines
  `encode(x) -> (stored, scales)`, `decode(stored, scales, dtype) -> values` and `create`.
  """

  @classmethod
  def quantized(cls, k: jax.Array, v: jax.Array, dtype: str = "float32"):
    """An entry holding float k, v [L, B, S, K, D] quantized."""
    (qk, sk), (qv, sv) = cls.encode(k), cls.encode(v)
    return cls(qk, qv, sk, sv, dtype)

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array):
    """Quantizes the block once: the stored entry, and the values the block reads as."""
    qk, sk = self.encode(k)
    qv, sv = self.encode(v)
    entry = self.replace(
      k=_write(self.k, layer, start, qk),
      v=_write(self.v, layer, start, qv),
      k_scale=_write(self.k_scale, layer, start, sk),
      v_scale=_write(self.v_scale, layer, start, sv),
    )
    return entry, self.decode(qk, sk, self.dtype), self.decode(qv, sv, self.dtype)

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    k = self.decode(
      _read(self.k, layer, offset, size), _read(self.k_scale, layer, offset, size), self.dtype
    )
    v = self.decode(
      _read(self.v, layer, offset, size), _read(self.v_scale, layer, offset, size), self.dtype
    )
    return k, v

  def commit_path(self, start: jax.Array, path: jax.Array):
    return self.replace(
      k=_move(self.k, start, path),
      v=_move(self.v, start, path),
      k_scale=_move(self.k_scale, start, path),
      v_scale=_move(self.v_scale, start, path),
    )

  def dequantized(self) -> FloatKV:
    """The float K/V this cache stands for (tests compare attention over both)."""
    return FloatKV(
      self.decode(self.k, self.k_scale, self.dtype), self.decode(self.v, self.v_scale, self.dtype)
    )


@flax.struct.dataclass
class FP8KV(_QuantizedKV):
  """Attention K/V of one segment in FP8: E4M3 k, v [L, B, S, K, D] and float32 scales
  [L, B, S, K], one per token and KV head. 1 byte per value + 4 per head vector: 1.9× smaller
  than bfloat16 at head_dim 128 (less with tiny heads).

  The E4M3 values are held as their bytes (uint8, bit-identical): XLA:CPU has no native float8
  scatter and converts the whole array around each block write (measured 23 ms per one-token
  write into a 32K-slot cache, against 0.04 ms for uint8). Reads bitcast each chunk back.
  """

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  format: ClassVar[str] = "fp8"
  AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES, "k_scale": SCALE_AXES, "v_scale": SCALE_AXES}

  @staticmethod
  def encode(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    q, scale = fp8_quantize(x)
    return fp8_bits(q), scale

  @staticmethod
  def decode(bits: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    return fp8_dequantize(fp8_values(bits), scale, dtype)

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "FP8KV":
    shape = (num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    values = lambda: jnp.zeros(shape, jnp.uint8)  # distinct buffers: the state is donated
    scales = lambda: jnp.ones(shape[:-1], jnp.float32)
    return cls(values(), values(), scales(), scales(), config.dtype)


@flax.struct.dataclass
class Q4KV(_QuantizedKV):
  """Attention K/V of one segment in llama.cpp's Q4_0: nibbles k, v [L, B, S, K, D/2] (uint8)
  and float16 scales [L, B, S, K, D/32], one per block of 32 values along head_dim. 18 bytes
  per 32 values: 4.5/32 of float32. Quantized once on write; each read dequantizes only the
  chunk it reads.
  """

  k: jax.Array
  v: jax.Array
  k_scale: jax.Array
  v_scale: jax.Array
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  format: ClassVar[str] = "q4_0"
  # Packed head_dim / 2 bytes and head_dim / 32 scales sit where head_dim does.
  AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES, "k_scale": KV_AXES, "v_scale": KV_AXES}

  encode = staticmethod(q4_0_quantize)
  decode = staticmethod(q4_0_dequantize)

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "Q4KV":
    if config.head_dim % Q4_BLOCK:
      raise ConfigError(
        f"kv_format='q4_0' needs head_dim to be a multiple of {Q4_BLOCK}, got {config.head_dim}"
      )
    lead = (num_layers, batch, max_len, config.num_kv_heads)
    values = lambda: jnp.zeros((*lead, config.head_dim // 2), jnp.uint8)
    scales = lambda: jnp.zeros((*lead, config.head_dim // Q4_BLOCK), jnp.float16)
    return cls(values(), values(), scales(), scales(), config.dtype)


KV_FORMATS = {"float": FloatKV, "fp8": FP8KV, "q4_0": Q4KV}

RING_EMPTY = -1  # the position of a ring slot nothing has been written to
NO_LIMIT = 2**31 - 1


@flax.struct.dataclass
class RingKV:
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
    cap = self.max_len
    rows, positions = _slots(start, k.shape[1])
    end = jnp.minimum(start + k.shape[1], self.limit)[:, None]
    keep = (positions < self.limit[:, None]) & (positions >= end - cap)
    slots = jnp.where(keep, positions % cap, cap)  # slot C is out of range: dropped
    k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
    put = lambda x, block: x.at[layer, rows, slots].set(block, mode="drop")
    return self.replace(k=put(self.k, k), v=put(self.v, v), pos=put(self.pos, positions)), k, v

  read = FloatKV.read

  def slot_positions(self, layer: jax.Array, offset: jax.Array, size: int) -> jax.Array:
    """[B, size] positions held by slots offset..offset+size−1 of `layer`."""
    return jax.lax.dynamic_slice(self.pos, (layer, 0, offset), (1, self.pos.shape[1], size))[0]

  def live_slots(self, start: jax.Array) -> jax.Array:
    """How many leading slots can hold a position < start (all of them once wrapped)."""
    return jnp.minimum(jnp.max(start), self.max_len)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "RingKV":
    raise NotImplementedError("a ring entry is rewritten by its owner's commit, not moved")


@flax.struct.dataclass
class LinearState:
  """Decoding state of a segment of Gated DeltaNet (linear-attention) layers: a fixed number of
  bytes per sequence, whatever the context length.

  conv [L, B, K−1, C]: the conv window (the last K−1 inputs of the q/k/v channels, activation
  dtype); ssm [L, B, H, Dk, Dv] float32: the delta-rule state; both after the committed tokens.

  A forward over a block of T ≤ `ModelConfig.linear_snapshots` tokens without `valid` lengths
  (decode, chain verification) leaves the state as it was and fills the *pending* fields:
  pending_conv [L, B, K−1+T, C] (the window before the block, then the block's conv inputs;
  rows a..a+K−2 are the window after a tokens) and pending_ssm [L, B, T+1, H, Dk, Dv] (the
  state after a = 0..T tokens), for the block at pending_start [B]. A tree block (ancestor mask)
  fills them per node instead (node i's conv input and the state after its root path), and
  `commit_path` reorders them along the accepted path so that they read as a chain. `DecodingState.with_lengths`
  (and `commit`) then keeps the snapshot of the committed prefix, a = lengths − pending_start,
  and drops the pending fields: only the committed state is carried between steps. Any other
  block (prefill with `valid` lengths, or a longer block, taken as committed whole) writes the
  state after its valid tokens directly. A block at position 0 starts from zeros.
  """

  conv: jax.Array
  ssm: jax.Array
  pending_conv: jax.Array | None = None
  pending_ssm: jax.Array | None = None
  pending_start: jax.Array | None = None

  format: ClassVar[str] = "linear"
  max_len: ClassVar[int] = 2**31 - 1  # no length limit of its own
  AXES: ClassVar[dict] = LINEAR_STATE_AXES

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int = 0) -> "LinearState":
    del max_len  # fixed size
    channels = 2 * config.linear_num_key_heads * config.linear_key_head_dim
    channels += config.linear_num_value_heads * config.linear_value_head_dim
    conv = (num_layers, batch, config.linear_conv_kernel_dim - 1, channels)
    ssm = (
      num_layers,
      batch,
      config.linear_num_value_heads,
      config.linear_key_head_dim,
      config.linear_value_head_dim,
    )
    return cls(jnp.zeros(conv, jnp.dtype(config.dtype)), jnp.zeros(ssm, jnp.float32))

  @property
  def has_pending(self) -> bool:
    return self.pending_ssm is not None

  def initial(self, layer: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(conv window [B, K−1, C], recurrent state [B, H, Dk, Dv]) a block at `start` resumes
    from: the committed state, or zeros at position 0 (a new sequence)."""
    fresh = start == 0
    window = jnp.where(fresh[:, None, None], 0, self.conv[layer])
    return window, jnp.where(fresh[:, None, None, None], 0.0, self.ssm[layer])

  def with_pending(self, start: jax.Array, t: int) -> "LinearState":
    """Room for the per-position states of a block of t tokens at `start`."""
    n, b, rows, c = self.conv.shape
    return self.replace(
      pending_conv=jnp.zeros((n, b, rows + t, c), self.conv.dtype),
      pending_ssm=jnp.zeros((n, b, t + 1, *self.ssm.shape[2:]), jnp.float32),
      pending_start=start.astype(jnp.int32),
    )

  def write_snapshots(
    self, layer: jax.Array, conv_inputs: jax.Array, s0: jax.Array, states: jax.Array
  ) -> "LinearState":
    """A short block's conv inputs [B, K−1+T, C], initial state and per-position states
    [B, T, H, Dk, Dv] into the pending fields."""
    ssm = jnp.concatenate([s0[:, None], states], axis=1)
    return self.replace(
      pending_conv=self.pending_conv.at[layer].set(conv_inputs.astype(self.conv.dtype)),
      pending_ssm=self.pending_ssm.at[layer].set(ssm),
    )

  def write_final(
    self, layer: jax.Array, n: jax.Array, conv_inputs: jax.Array, final: jax.Array
  ) -> "LinearState":
    """The state after the first n [B] tokens of a block (conv inputs [B, K−1+T, C])."""
    k = self.conv.shape[2]
    rows = jnp.arange(n.shape[0])[:, None]
    window = conv_inputs[rows, n[:, None] + jnp.arange(k)[None, :]]
    return self.replace(
      conv=self.conv.at[layer].set(window.astype(self.conv.dtype)),
      ssm=self.ssm.at[layer].set(final),
    )

  def committed(self, lengths: jax.Array) -> "LinearState":
    """The state after `lengths` tokens: the pending snapshot of the committed prefix (a =
    lengths − pending_start, clipped to the block), pending fields dropped."""
    if not self.has_pending:
      return self
    t = self.pending_ssm.shape[2] - 1
    k = self.conv.shape[2]
    a = jnp.clip(lengths - self.pending_start, 0, t)  # [B]
    rows = jnp.arange(a.shape[0])
    cols = a[:, None] + jnp.arange(k)[None, :]
    conv = self.pending_conv[:, rows[:, None], cols]  # [L, B, K−1, C]
    ssm = self.pending_ssm[:, rows, a]  # [L, B, H, Dk, Dv]
    return LinearState(conv, ssm)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "LinearState":
    """Reorders a tree block's per-node snapshots so that the accepted path (node indices
    [B, n], root first) reads as a chain: snapshot a (after a tokens) ← the state after node
    path[a − 1], conv input K−2+a ← node path[a − 1]'s. `committed` then keeps a = lengths −
    pending_start as for a chain prefix: the accepted node's state and the last K−1 conv inputs
    of its root path (the old window's tail when the path is shorter). `start` is implied by
    pending_start."""
    del start
    if not self.has_pending:
      raise ConfigError("commit_path on a LinearState without a tree block's per-node states")
    k = self.conv.shape[2]
    rows = jnp.arange(path.shape[0])[:, None]
    to = jnp.arange(path.shape[1])[None, :]
    conv = self.pending_conv.at[:, rows, k + to].set(self.pending_conv[:, rows, k + path])
    ssm = self.pending_ssm.at[:, rows, 1 + to].set(self.pending_ssm[:, rows, 1 + path])
    return self.replace(pending_conv=conv, pending_ssm=ssm)


@flax.struct.dataclass
class DecodingState:
  """The model's decoding state: one entry per layer segment plus committed lengths [B].

  A forward takes it, writes its block into every entry and returns it with `lengths`
  unchanged; the caller then commits what was accepted (`commit` for a chain prefix,
  `commit_path` first for a tree path).
  """

  segments: tuple
  lengths: jax.Array  # [B] int32: committed tokens per sequence

  AXES: ClassVar[dict] = {"lengths": ROW_AXES}  # the segments name their own

  @classmethod
  def create(
    cls,
    config,
    batch: int,
    max_len: int,
    kv_format: str = "float",
    segment_layers: tuple[int, ...] | None = None,
  ) -> "DecodingState":
    """A zero state for `config`'s main stack (or for runs of `segment_layers` layers, e.g.
    (1,) for one MTP or drafter layer)."""
    if kv_format not in KV_FORMATS:
      raise ConfigError(f"kv_format={kv_format!r}; expected one of {tuple(KV_FORMATS)}")
    kind = KV_FORMATS[kv_format]
    if segment_layers is None:  # the main stack: linear-attention runs get a LinearState
      kinds = [
        LinearState if config.is_linear(first) else kind for first, _, _ in config.segments()
      ]
      segment_layers = tuple(n for _, n, _ in config.segments())
    else:
      kinds = [kind] * len(segment_layers)
    return cls(
      tuple(k.create(config, n, batch, max_len) for k, n in zip(kinds, segment_layers)),
      jnp.zeros((batch,), jnp.int32),
    )

  @property
  def max_len(self) -> int:
    return min(s.max_len for s in self.segments)

  @property
  def kv_format(self) -> str:
    formats = [s.format for s in self.segments if s.format != LinearState.format]
    return formats[0] if formats else "float"

  def with_lengths(self, lengths: jax.Array) -> "DecodingState":
    """The state with `lengths` committed tokens per sequence; a recurrent entry keeps the
    snapshot of that prefix from its last block (LinearState.committed)."""
    lengths = lengths.astype(jnp.int32)
    segments = tuple(
      s.committed(lengths) if isinstance(s, LinearState) else s for s in self.segments
    )
    return self.replace(segments=segments, lengths=lengths)

  def commit(self, num_new: jax.Array) -> "DecodingState":
    """Advances each sequence's committed length by num_new [B]."""
    return self.with_lengths(self.lengths + num_new)

  def commit_path(self, path: jax.Array) -> "DecodingState":
    """Moves an accepted tree path (node indices [B, n], root first) of the block written at
    slots lengths.. to slots lengths..lengths+n-1 in every segment; lengths are unchanged."""
    return self.replace(segments=tuple(s.commit_path(self.lengths, path) for s in self.segments))


# --------------------------------------------------------------------------------------------------
# Logical axes of a whole state pytree
# --------------------------------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def _batch_axis(where: str, one: tuple, two: tuple) -> Optional[int]:
  """The axis whose size goes 1 → 2 from the 1-row to the 2-row state (None: shared by rows)."""
  moved = [i for i, (a, b) in enumerate(zip(one, two)) if a != b]
  if len(moved) > 1 or (moved and (one[moved[0]], two[moved[0]]) != (1, 2)):
    raise ConfigError(f"state leaf {where} of shape {one} has no single batch axis")
  return moved[0] if moved else None


def logical_axes(tree: Any, two_rows: Any = None) -> Any:
  """The logical axes of a state pytree: one `PartitionSpec` of logical names per array leaf,
  in `tree`'s structure (for `jaxspec.sharding.shardings_for` / `with_logical_constraints`).

  A struct whose class has an `AXES` table (field name → a logical name or None per dimension,
  as the kinds above) names those fields; its other fields and plain containers are walked. With
  `two_rows`, the same state for 2 rows while `tree` has 1 (arrays or `jax.eval_shape` shapes),
  every leaf's batch axis is found by comparing the two: a leaf nothing names gets `batch` there
  and no name elsewhere (a drafter state field without a table is still split by rows), and a
  named leaf whose `batch` is elsewhere is a ConfigError, so a wrong table cannot go unnoticed.
  Without `two_rows` an unnamed leaf is a ConfigError.
  """

  def leaf(path, x, y, names):
    where, shape = jax.tree_util.keystr(path) or "<root>", tuple(np.shape(x))
    batch = None if y is None else _batch_axis(where, shape, tuple(np.shape(y)))
    if names is None:
      if y is None:
        raise ConfigError(
          f"state leaf {where} (shape {shape}) has no logical axes: name them in the AXES "
          "table of the struct that holds it"
        )
      names = tuple("batch" if i == batch else None for i in range(len(shape)))
    names = tuple(names)
    if len(names) != len(shape):
      raise ConfigError(f"state leaf {where} of shape {shape} is named {names}: one name per axis")
    named_batch = names.index("batch") if "batch" in names else None
    if y is not None and named_batch != batch:
      raise ConfigError(
        f"state leaf {where} of shape {shape} is named {names}, but its batch axis is {batch}"
      )
    return PartitionSpec(*names)

  def walk(path, x, y, names=None):
    if x is None:
      return None
    if _is_array(x):
      return leaf(path, x, y, names)
    if names is not None:
      raise ConfigError(f"{jax.tree_util.keystr(path)}: an AXES table names a non-array field")
    kids, treedef = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda n: n is not x)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:  # not a container, not an array
      raise ConfigError(f"state leaf {jax.tree_util.keystr(path)} is not an array: {type(x)}")
    others = [None] * len(kids) if y is None else treedef.flatten_up_to(y)
    table = getattr(type(x), "AXES", {})
    out = [
      walk(path + key, kid, other, table.get(getattr(key[0], "name", None)))
      for (key, kid), other in zip(kids, others)
    ]
    return treedef.unflatten(out)

  return walk((), tree, two_rows)
