"""Element codecs shared by quantized weights and quantized decoding states.

* FP8 E4M3 with one float32 scale per vector (`fp8_quantize` / `fp8_dequantize`): a KV vector's
  head dim, or a weight's contraction axes per output channel. `fp8_bits` / `fp8_values` convert
  to and from the uint8 storage form (arrays of E4M3 do not travel everywhere uint8 does).
* INT4 symmetric with one scale per group of values (`int4_quantize` / `int4_dequantize`),
  packed two to a byte in compressed-tensors' nibble order: 4.5 bits a value at group 32 with
  bf16 scales.
* Q4_0, llama.cpp's `block_q4_0` (`q4_0_quantize` / `q4_0_dequantize`): blocks of 32 values, one
  fp16 scale, 4.5 bits a value.

Pure jnp; no jaxspec imports, so both `jaxspec.state` and `jaxspec.quant.formats` build on it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value


def fp8_quantize(x: jax.Array, axes: tuple[int, ...] = (-1,)) -> tuple[jax.Array, jax.Array]:
  """x → (E4M3 values like x, float32 scales with `axes` removed): one scale per vector along
  `axes` (the head dim of a KV vector; a weight's contraction axes, per output channel).

  scale = amax / 448 so the largest element maps to E4M3's largest finite value; an all-zero
  vector gets scale 1 (its values stay 0).
  """
  xf = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(xf), axis=axes, keepdims=True)
  scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  q = jnp.clip(xf / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
  return q, jnp.squeeze(scale, axes)


def fp8_dequantize(
  q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32, axes: tuple[int, ...] = (-1,)
) -> jax.Array:
  return (q.astype(jnp.float32) * jnp.expand_dims(scale, axes)).astype(dtype)


def fp8_bits(q: jax.Array) -> jax.Array:
  """E4M3 values → their bytes (uint8), the storage form (see FP8KV)."""
  return jax.lax.bitcast_convert_type(q, jnp.uint8)


def fp8_values(bits: jax.Array) -> jax.Array:
  """Stored bytes → E4M3 values."""
  return jax.lax.bitcast_convert_type(bits, FP8_DTYPE)


Q4_BLOCK = 32  # values per Q4_0 block (llama.cpp's QK4_0)


def q4_0_quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """x [..., D] (D a multiple of 32) → (packed nibbles uint8 [..., D/2], float16 scales
  [..., D/32]): llama.cpp's `quantize_row_q4_0_ref`, bit for bit.

  Per block of 32: the element of largest magnitude (the first, on ties) is `max`; d = max / −8;
  q = min(15, trunc(x / d + 8.5)) (x · (1/d) in float32, as the reference computes it); byte j
  of a block holds q[j] in its low nibble and q[j + 16] in its high one; d is stored as fp16.
  """
  xf = x.astype(jnp.float32)
  blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // Q4_BLOCK, Q4_BLOCK)
  first_max = jnp.argmax(jnp.abs(blocks), axis=-1)[..., None]
  peak = jnp.take_along_axis(blocks, first_max, axis=-1)  # signed
  d = peak / -8.0
  inv = jnp.where(d != 0, 1.0 / jnp.where(d != 0, d, 1.0), 0.0)
  scaled = jax.lax.optimization_barrier(blocks * inv)  # rounded before the add, as in C
  q = jnp.minimum(15, jnp.trunc(scaled + 8.5)).astype(jnp.uint8)
  half = Q4_BLOCK // 2
  packed = q[..., :half] | (q[..., half:] << 4)
  return packed.reshape(*xf.shape[:-1], xf.shape[-1] // 2), d[..., 0].astype(jnp.float16)


def q4_0_dequantize(packed: jax.Array, d: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
  """Inverse of `q4_0_quantize`: (q − 8) · d per value (llama.cpp's `dequantize_row_q4_0`)."""
  half = Q4_BLOCK // 2
  blocks = packed.reshape(*packed.shape[:-1], packed.shape[-1] // half, half)
  lo = (blocks & 0x0F).astype(jnp.int32) - 8
  hi = (blocks >> 4).astype(jnp.int32) - 8
  q = jnp.concatenate([lo, hi], axis=-1).astype(jnp.float32)
  x = q * d.astype(jnp.float32)[..., None]
  return x.reshape(*packed.shape[:-1], packed.shape[-1] * 2).astype(dtype)


INT4_OFFSET = 8  # a stored nibble is q + 8 (offset binary), q in [-8, 7]


def int4_quantize(
  x: jax.Array, group: int, scale_dtype: Any = jnp.bfloat16
) -> tuple[jax.Array, jax.Array]:
  """x [..., K] → (packed nibbles uint8 [..., 4·ceil(K/8)], scales [..., ceil(K/group)]):
  symmetric 4-bit integers, w = q · scale, one scale per `group` consecutive values.

  scale = amax / 7 (rounded to `scale_dtype` first, so q is computed against the stored scale);
  q = clip(round(x / scale), −8, 7). Byte j holds values 2j (low nibble) and 2j + 1 (high), each
  as q + 8, so that four bytes read as a little-endian int32 are compressed-tensors' packed word
  (value 8k + i in nibble i). K is padded with zeros to a multiple of 8 (and of `group`).
  """
  xf = x.astype(jnp.float32)
  k = xf.shape[-1]
  n_groups = -(-k // group)
  padded = jnp.pad(xf, [(0, 0)] * (xf.ndim - 1) + [(0, n_groups * group - k)])
  groups = padded.reshape(*xf.shape[:-1], n_groups, group)
  amax = jnp.max(jnp.abs(groups), axis=-1, keepdims=True)
  scale = jnp.where(amax > 0, amax / 7.0, 1.0).astype(scale_dtype)
  q = jnp.clip(jnp.round(groups / scale.astype(jnp.float32)), -8, 7).astype(jnp.int32)
  q = q.reshape(*xf.shape[:-1], n_groups * group)[..., :k]
  words = -(-k // 8) * 8
  nib = jnp.pad(q + INT4_OFFSET, [(0, 0)] * (q.ndim - 1) + [(0, words - k)], constant_values=8)
  packed = (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(jnp.uint8)
  return packed, scale[..., 0]


def int4_dequantize(
  packed: jax.Array, scales: jax.Array, k: int, group: int, dtype: Any = jnp.float32
) -> jax.Array:
  """Inverse of `int4_quantize` for K = `k` values a row in groups of `group`: q · scale in
  float32 (exact: a 4-bit integer times a bf16 or float32 scale), cast to dtype."""
  lo = (packed & 0x0F).astype(jnp.int32) - INT4_OFFSET
  hi = (packed >> 4).astype(jnp.int32) - INT4_OFFSET
  q = jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], -1)[..., :k]
  s = jnp.repeat(scales.astype(jnp.float32), group, axis=-1)[..., :k]
  return (q.astype(jnp.float32) * s).astype(dtype)
