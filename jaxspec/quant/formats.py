"""Quantized weight formats and the one seam every matmul reads its weights through.

A weight is either an array or a `QTensor`: packed values, their scales and the format, a
pytree that sits in the parameter tree where the array was (scanned or per-layer layouts
alike). Modules never look inside: they call `materialize(w, dtype)` for a matmul operand or
`take(w, ids)` for rows of it (the MoE decode path reads only the selected experts), and get the
dequantized values; a plain array passes through as `w.astype(dtype)`.

Formats:

* "mxfp4": OCP Microscaling v1.0 MXFP4. Elements are E2M1 (±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), one
  E8M0 scale (a power of two, bias 127; 0xFF is NaN) per block of 32 elements along the
  weight's contraction axis, two elements per byte, the even element in the low nibble: 4.25
  bits per weight. Stored as gpt-oss stores its experts: the contraction axis moved last and cut
  into blocks, `values` uint8 [..., n_blocks, 16] and `scales` uint8 [..., n_blocks]. Quantizing
  picks the scale 2^(floor(log2 amax) − 2) (E2M1's largest exponent is 2), rounds x / scale to
  the nearest E2M1 value (ties to even) and saturates at ±6.
* "fp8": E4M3 weight-only with one float32 scale per output channel (amax over the contraction
  axes / 448); activations stay in the compute dtype.
* "fp8_block": E4M3 with one float32 scale per block of the HF [out, in] matrix (128 × 128 in
  DeepSeek-V3 and Qwen3 FP8 checkpoints, `weight_scale_inv`), kept as imported: values in HF's
  layout, mapped to jaxspec's when dequantized. Import only (`jaxspec.quantize` writes "fp8").
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.quant import codecs

MX_BLOCK = 32  # elements per shared scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E2M1_EMAX = 2  # exponent of E2M1's largest normal value (6 = 1.5 · 2²)
# The 16 E2M1 codes: sign bit 3, exponent bits 2–1, mantissa bit 0.
E2M1_VALUES = np.array(
  [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
  np.float32,
)
# Rounding |x| to the E2M1 magnitudes: code = how many of these midpoints |x| is past. A tie
# goes to the even code: past the midpoint above an even code only if strictly greater.
_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_TIE_GOES_UP = np.array([False, True, False, True, False, True, False])

FORMATS = ("mxfp4", "fp8", "int4")
INT4_GROUP = 32  # values per scale when jaxspec quantizes to int4 (Kimi-K2's group)


@flax.struct.dataclass
class QTensor:
  """A quantized weight (see the module docstring).

  values / scales: the stored arrays. format: "mxfp4", "fp8", "fp8_block" or "int4". axes: the
  contraction axes as negative indices into the dequantized array (so a stack of layers or
  experts in front does not change them); MXFP4 blocks run along the last of them. dtype:
  what dequantizing gives.
  """

  values: jax.Array
  scales: jax.Array
  format: str = flax.struct.field(pytree_node=False)
  axes: tuple[int, ...] = flax.struct.field(pytree_node=False)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  # "fp8_block": (HF tensor kind, the matrix's jaxspec shape, (block_out, block_in)).
  # "int4": (group, the contraction axes' sizes).
  layout: tuple = flax.struct.field(pytree_node=False, default=())

  @property
  def shape(self) -> tuple[int, ...]:
    if self.format == "fp8":
      return tuple(self.values.shape)
    if self.format == "fp8_block":
      return (*self.values.shape[:-2], *self.layout[1])
    if self.format == "int4":
      return _int4_shape(tuple(self.values.shape[:-1]), self.layout[1], self.axes)
    moved = (*self.values.shape[:-2], self.values.shape[-2] * 2 * self.values.shape[-1])
    return _unmove_shape(moved, self.axes[-1])

  @property
  def nbytes(self) -> int:
    return int(self.values.size * self.values.dtype.itemsize) + int(
      self.scales.size * self.scales.dtype.itemsize
    )

  def dequantize(self, dtype: Any = None) -> jax.Array:
    dtype = dtype or self.dtype
    if self.format == "fp8":
      return codecs.fp8_dequantize(self.values, self.scales, dtype, self.axes)
    if self.format == "fp8_block":
      return fp8_block_dequantize(self.values, self.scales, self.layout, dtype)
    if self.format == "int4":
      return int4_dequantize(self.values, self.scales, self.layout, self.axes, dtype)
    return mxfp4_dequantize(self.values, self.scales, self.axes[-1], dtype)


def _unmove_shape(moved: tuple[int, ...], axis: int) -> tuple[int, ...]:
  shape = list(moved[:-1])
  shape.insert(len(moved) + axis if axis < -1 else len(moved) - 1, moved[-1])
  return tuple(shape)


def is_quantized(w: Any) -> bool:
  return isinstance(w, QTensor)


def materialize(w: Any, dtype: Any) -> jax.Array:
  """A matmul operand: the dequantized values of a QTensor, or the array cast to `dtype`."""
  if isinstance(w, QTensor):
    return w.dequantize(dtype)
  return w.astype(dtype)


def take(w: Any, ids: jax.Array, dtype: Any) -> jax.Array:
  """w[ids] along the leading axis (e.g. the selected experts), dequantizing only those rows."""
  if isinstance(w, QTensor):
    return w.replace(values=w.values[ids], scales=w.scales[ids]).dequantize(dtype)
  return w[ids].astype(dtype)


def nbytes(w: Any) -> int:
  """Stored bytes of a weight (array or QTensor)."""
  if isinstance(w, QTensor):
    return w.nbytes
  return int(np.prod(w.shape)) * jnp.dtype(w.dtype).itemsize


# ------------------------------------------------------------------------------------------------
# MXFP4
# ------------------------------------------------------------------------------------------------


def e2m1_codes(x: jax.Array) -> jax.Array:
  """float32 values already divided by their scale → E2M1 codes (uint8 0..15), round to
  nearest with ties to even, saturating at ±6."""
  a = jnp.abs(x)
  mids = jnp.asarray(_MIDPOINTS)
  past = jnp.where(jnp.asarray(_TIE_GOES_UP), a[..., None] >= mids, a[..., None] > mids)
  code = jnp.sum(past, axis=-1).astype(jnp.uint8)
  sign = (jnp.signbit(x) & (code > 0)).astype(jnp.uint8)  # −0 stores as +0
  return code | (sign << 3)


def mxfp4_quantize(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
  """x → (values uint8 [..., n_blocks, 16], scales uint8 [..., n_blocks]) with blocks of 32
  along `axis` (moved last). The axis length must be a multiple of 32."""
  x = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
  n = x.shape[-1]
  if n % MX_BLOCK:
    raise ConfigError(f"MXFP4 needs the contraction axis to be a multiple of {MX_BLOCK}, got {n}")
  blocks = x.reshape(*x.shape[:-1], n // MX_BLOCK, MX_BLOCK)
  amax = jnp.max(jnp.abs(blocks), axis=-1)
  safe = jnp.where(amax > 0, amax, 1.0)
  # floor(log2 amax) from the float32 exponent field: exact, unlike jnp.log2.
  exp = jnp.frexp(safe)[1].astype(jnp.int32) - 1
  shared = jnp.where(amax > 0, exp - E2M1_EMAX, -E8M0_BIAS)
  shared = jnp.clip(shared, -E8M0_BIAS, E8M0_BIAS)
  scaled = blocks * jnp.ldexp(jnp.float32(1.0), -shared)[..., None]
  codes = e2m1_codes(scaled)
  packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
  return packed.astype(jnp.uint8), (shared + E8M0_BIAS).astype(jnp.uint8)


def mxfp4_dequantize(
  values: jax.Array, scales: jax.Array, axis: int = -1, dtype: Any = jnp.float32
) -> jax.Array:
  """Exact inverse of the storage: E2M1 value · 2^(scale − 127), blocks back on `axis`."""
  lut = jnp.asarray(E2M1_VALUES)
  lo, hi = lut[values & 0x0F], lut[values >> 4]
  elems = jnp.stack([lo, hi], axis=-1).reshape(*values.shape[:-1], MX_BLOCK)
  exp = scales.astype(jnp.int32) - E8M0_BIAS
  x = jnp.ldexp(elems, exp[..., None]).reshape(*values.shape[:-2], -1)
  return jnp.moveaxis(x, -1, axis).astype(dtype)


def check_mxfp4_scales(scales: np.ndarray, name: str) -> None:
  """Refuses a checkpoint's E8M0 scales holding the NaN code (0xFF)."""
  bad = int(np.sum(np.asarray(scales) == E8M0_NAN))
  if bad:
    raise CheckpointError(f"{name}: {bad} MXFP4 scales are 0xFF (NaN in E8M0)")


# ------------------------------------------------------------------------------------------------
# FP8 with block scales (imported checkpoints)
# ------------------------------------------------------------------------------------------------


def hf_to_jax_layout(w: jax.Array, kind: str, shape: tuple[int, ...]) -> jax.Array:
  """[..., out, in] (HF) → the jaxspec matrix `shape` ([in, out], or heads split out)."""
  w = jnp.swapaxes(w, -1, -2)
  if kind == "linear":
    return w
  if kind in ("in_heads", "out_heads"):
    return w.reshape(*w.shape[:-2], *shape)
  raise ConfigError(f"no FP8 block layout for a {kind} tensor")


def fp8_block_dequantize(
  values: jax.Array, scales: jax.Array, layout: tuple, dtype: Any = jnp.float32
) -> jax.Array:
  """E4M3 values [..., out, in] times their block's scale, in jaxspec's layout."""
  kind, shape, (bo, bi) = layout
  out, inp = values.shape[-2:]
  s = jnp.repeat(jnp.repeat(scales.astype(jnp.float32), bo, axis=-2), bi, axis=-1)
  w = values.astype(jnp.float32) * s[..., :out, :inp]
  return hf_to_jax_layout(w, kind, tuple(shape)).astype(dtype)


# ------------------------------------------------------------------------------------------------
# INT4 with group scales (compressed-tensors pack-quantized; jaxspec.quantize)
# ------------------------------------------------------------------------------------------------


def _int4_shape(other: tuple, cdims: tuple, axes: tuple[int, ...]) -> tuple[int, ...]:
  """The weight's shape from its non-contraction dims and contraction dims (put back at
  `axes`, negative indices), undoing the move of `int4_quantize`."""
  n = len(other) + len(cdims)
  at = {n + a: d for a, d in zip(axes, cdims)}
  rest = iter(other)
  return tuple(at[i] if i in at else next(rest) for i in range(n))


def int4_quantize(w: jax.Array, axes: tuple[int, ...], group: int = INT4_GROUP) -> QTensor:
  """A float weight → an "int4" QTensor: contraction axes `axes` moved last and flattened,
  quantized in groups of `group` along them (codecs.int4_quantize), scales bf16."""
  moved = jnp.moveaxis(w, axes, tuple(range(-len(axes), 0)))
  cdims = tuple(int(d) for d in moved.shape[moved.ndim - len(axes) :])
  flat = moved.reshape(*moved.shape[: moved.ndim - len(axes)], -1)
  values, scales = codecs.int4_quantize(flat, group)
  return QTensor(values, scales, "int4", tuple(axes), str(jnp.dtype(w.dtype)), (group, cdims))


def int4_dequantize(
  values: jax.Array, scales: jax.Array, layout: tuple, axes: tuple[int, ...], dtype: Any
) -> jax.Array:
  """The float weight of an "int4" QTensor's stored arrays, in jaxspec's layout."""
  group, cdims = layout
  flat = codecs.int4_dequantize(values, scales, int(np.prod(cdims)), group, dtype)
  moved = flat.reshape(*flat.shape[:-1], *cdims)
  return jnp.moveaxis(moved, tuple(range(-len(axes), 0)), axes)


# ------------------------------------------------------------------------------------------------
# Quantizing one weight
# ------------------------------------------------------------------------------------------------


def quantize_weight(w: Any, fmt: str, axes: tuple[int, ...]) -> QTensor:
  """Quantizes a float weight in `fmt` with contraction axes `axes` (negative indices)."""
  if fmt not in FORMATS:
    raise ConfigError(f"unknown weight format {fmt!r}; expected one of {FORMATS} (or 'none')")
  if any(a >= 0 for a in axes):
    raise ConfigError(f"contraction axes must be negative indices, got {axes}")
  w = jnp.asarray(w)
  if fmt == "fp8":
    values, scales = codecs.fp8_quantize(w, axes)
  elif fmt == "int4":
    return int4_quantize(w, tuple(axes))
  else:
    values, scales = mxfp4_quantize(w, axes[-1])
  return QTensor(values, scales, fmt, tuple(axes), str(jnp.dtype(w.dtype)))


def stored_axes(logical: tuple, fmt: str, axes: tuple[int, ...]) -> tuple[tuple, tuple]:
  """Logical axis names of a quantized weight's (values, scales), from the weight's own names
  and its contraction axes (negative indices), so the stored arrays shard like the weight.

  fp8: values as the weight, scales without the contraction axes. mxfp4: the contraction axis
  moved last and cut into blocks (the blocks keep its name, the 16 bytes of a block have none);
  scales name one entry per block. int4: the contraction axes moved last and flattened
  (named as the contraction axis when there is one, else unnamed), in values and scales alike.
  """
  n = len(logical)
  if fmt == "fp8":
    keep = tuple(a for i, a in enumerate(logical) if i - n not in axes)
    return tuple(logical), keep
  if fmt == "mxfp4":
    c = axes[-1] + n
    moved = tuple(logical[:c]) + tuple(logical[c + 1 :]) + (logical[c],)
    return moved + (None,), moved
  if fmt == "int4":
    other = tuple(a for i, a in enumerate(logical) if i - n not in axes)
    k = logical[n + axes[0]] if len(axes) == 1 else None
    return other + (k,), other + (k,)
  raise ConfigError(f"no stored layout for format {fmt!r}; expected one of {FORMATS}")


def stored_logical_axes(params: Any, logical: Any) -> Any:
  """`logical` (the float parameter tree's logical PartitionSpecs) matched to `params`: where
  params holds a QTensor, its values and scales get their own names (`stored_axes`), so a
  quantized target shards like its float original (sharding.shard_tree)."""
  spec_leaf = lambda x: isinstance(x, jax.sharding.PartitionSpec)

  def one(spec: Any, w: Any) -> Any:
    if not is_quantized(w):
      return spec
    values, scales = stored_axes(tuple(spec), w.format, w.axes)
    return w.replace(
      values=jax.sharding.PartitionSpec(*values), scales=jax.sharding.PartitionSpec(*scales)
    )

  return jax.tree_util.tree_map(one, logical, params, is_leaf=spec_leaf)
