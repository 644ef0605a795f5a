"""Full-length attention caches: slot s holds position s (float, FP8 and Q4_0 kinds)."""

from __future__ import annotations

from typing import Any, ClassVar

import flax.struct
import jax
import jax.numpy as jnp

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
from jaxspec.state.base import (
  KV_AXES,
  SCALE_AXES,
  KVChunk,
  Kind,
  block_slots,
  move_path,
  put_slots,
  read_slots,
  take_slots,
)


def kv_shapes(config, num_layers: int, batch: int, slots: int) -> tuple[tuple, tuple]:
  """The [L, B, S, K, D] shapes of K and of V for `config`'s geometry: keys of head_dim, values
  of `value_head_dim` where the config has one (MiMo's are narrower), K = num_kv_heads."""
  lead = (num_layers, batch, slots, config.num_kv_heads)
  return (*lead, config.head_dim), (*lead, getattr(config, "value_head_dim", config.head_dim))


def _positions(offset: jax.Array, size: int, batch: int) -> jax.Array:
  """[B, size]: slots offset.. of a full-length cache, each holding its own position."""
  return jnp.broadcast_to(offset + jnp.arange(size, dtype=jnp.int32)[None, :], (batch, size))


class FullLengthKV(Kind):
  """A full-length cache: slot s holds position s, every position up to max_len."""

  @property
  def kv_format(self) -> str:
    return self.format

  def read_range(self, start: jax.Array, lowest: jax.Array | None = None):
    """(lo, hi): slots from the lowest a window reaches up to the longest live prefix."""
    lo = 0 if lowest is None else jnp.clip(lowest, 0, None)
    return lo, jnp.max(start)

  def read_chunk(self, layer: jax.Array, offset: jax.Array, size: int, start: jax.Array):
    k, v = self.read(layer, offset, size)
    pos = _positions(offset, size, k.shape[0])
    return KVChunk(k, v, pos, pos < start[:, None])


@flax.struct.dataclass
class FloatKV(FullLengthKV):
  """Attention K/V of one segment in a float dtype: k, v [L, B, S, K, D]."""

  k: jax.Array
  v: jax.Array

  format: ClassVar[str] = "float"
  AXES: ClassVar[dict] = {"k": KV_AXES, "v": KV_AXES}

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "FloatKV":
    k_shape, v_shape = kv_shapes(config, num_layers, batch, max_len)
    dtype = jnp.dtype(config.dtype)
    return cls(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype))

  @property
  def max_len(self) -> int:
    return self.k.shape[2]

  def write(
    self, layer: jax.Array, start: jax.Array, k: jax.Array, v: jax.Array
  ) -> tuple["FloatKV", jax.Array, jax.Array]:
    return self.put(layer, *block_slots(start, k.shape[1]), k, v)

  def put(self, layer: jax.Array, rows: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array):
    """A block's k, v [B, T, ...] at explicit slots [B, T] of `layer` (slot S: dropped), for
    kinds that map positions to slots themselves (state/sliding.py); → (entry, k, v stored)."""
    k, v = k.astype(self.k.dtype), v.astype(self.v.dtype)
    put = lambda x, block: put_slots(x, layer, rows, slots, block)
    return self.replace(k=put(self.k, k), v=put(self.v, v)), k, v

  def take(self, layer: jax.Array, rows: jax.Array, slots: jax.Array):
    """Float K/V [B, T, ...] at explicit rows and slots [B, T] of `layer` (the inverse of
    `put`; out of range: zeros)."""
    return take_slots(self.k, layer, rows, slots), take_slots(self.v, layer, rows, slots)

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    return read_slots(self.k, layer, offset, size), read_slots(self.v, layer, offset, size)

  def commit_path(self, start: jax.Array, path: jax.Array) -> "FloatKV":
    return self.replace(k=move_path(self.k, start, path), v=move_path(self.v, start, path))

  def kernel_operands(self) -> dict:
    return dict(k=self.k, v=self.v)


class _QuantizedKV(FullLengthKV):
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
    return self.put(layer, *block_slots(start, k.shape[1]), k, v)

  def put(self, layer: jax.Array, rows: jax.Array, slots: jax.Array, k: jax.Array, v: jax.Array):
    """As `write`, at explicit slots [B, T] (slot S: dropped; see FloatKV.put)."""
    (qk, sk), (qv, sv) = self.encode(k), self.encode(v)
    put = lambda x, block: put_slots(x, layer, rows, slots, block)
    entry = self.replace(
      k=put(self.k, qk),
      v=put(self.v, qv),
      k_scale=put(self.k_scale, sk),
      v_scale=put(self.v_scale, sv),
    )
    return entry, self.decode(qk, sk, self.dtype), self.decode(qv, sv, self.dtype)

  def take(self, layer: jax.Array, rows: jax.Array, slots: jax.Array):
    """As `FloatKV.take`: the values at explicit rows and slots, dequantized."""
    piece = lambda x: take_slots(x, layer, rows, slots)
    k = self.decode(piece(self.k), piece(self.k_scale), self.dtype)
    v = self.decode(piece(self.v), piece(self.v_scale), self.dtype)
    return k, v

  def read(self, layer: jax.Array, offset: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
    piece = lambda x: read_slots(x, layer, offset, size)
    k = self.decode(piece(self.k), piece(self.k_scale), self.dtype)
    v = self.decode(piece(self.v), piece(self.v_scale), self.dtype)
    return k, v

  def commit_path(self, start: jax.Array, path: jax.Array):
    return self.replace(
      k=move_path(self.k, start, path),
      v=move_path(self.v, start, path),
      k_scale=move_path(self.k_scale, start, path),
      v_scale=move_path(self.v_scale, start, path),
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

  def kernel_operands(self) -> dict:
    """The stored bytes viewed as E4M3 (a same-width bitcast, no conversion) and the scales."""
    return dict(
      k=fp8_values(self.k), v=fp8_values(self.v), k_scale=self.k_scale, v_scale=self.v_scale
    )

  @classmethod
  def create(cls, config, num_layers: int, batch: int, max_len: int) -> "FP8KV":
    k_shape, v_shape = kv_shapes(config, num_layers, batch, max_len)
    values = lambda shape: jnp.zeros(shape, jnp.uint8)  # distinct buffers: the state is donated
    scales = lambda: jnp.ones(k_shape[:-1], jnp.float32)
    return cls(values(k_shape), values(v_shape), scales(), scales(), config.dtype)


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
    k_shape, v_shape = kv_shapes(config, num_layers, batch, max_len)
    if k_shape[-1] % Q4_BLOCK or v_shape[-1] % Q4_BLOCK:
      raise ConfigError(
        f"kv_format='q4_0' needs head_dim to be a multiple of {Q4_BLOCK}, got keys of "
        f"{k_shape[-1]} and values of {v_shape[-1]}"
      )
    values = lambda shape: jnp.zeros((*shape[:-1], shape[-1] // 2), jnp.uint8)
    scales = lambda shape: jnp.zeros((*shape[:-1], shape[-1] // Q4_BLOCK), jnp.float16)
    return cls(values(k_shape), values(v_shape), scales(k_shape), scales(v_shape), config.dtype)


KV_FORMATS = {"float": FloatKV, "fp8": FP8KV, "q4_0": Q4KV}
