"""Pure-jnp oracle for the dense quantized matmul: dequantize the weight, then one dot.

  y[M, N] = x[M, K] @ W[K, N]          (float32 out)

The weight is 2-D and given by its stored arrays, in one of these formats (each is what
`jaxspec.quant.formats` stores for a 2-D weight, flattened to a matrix):

* "float":     values float [K, N]; scales None.
* "fp8":       values float8_e4m3fn (or its uint8 bytes) [K, N]; scales float32 [N], one per
               output channel (W = values · scales[None, :]).
* "fp8_block": values float8_e4m3fn (or uint8) [N, K], HF's [out, in] layout; scales float32
               [ceil(N / bo), ceil(K / bi)], one per (bo × bi) block (`block`, default 128 × 128).
* "mxfp4":     values uint8 [N, K/32, 16] (two E2M1 codes a byte, the even element in the low
               nibble); scales uint8 [N, K/32] (E8M0, 2^(s − 127)): the contraction axis last.
               Or grouped along K: values [G, N, K/G/32, 16], scales [G, N, K/G/32], the storage
               of a weight with two contraction axes [G, K/G, N] blocked along the second (an
               output projection [heads, head_dim, hidden]); x's K runs over (g, k) in that order.

Every dequantized weight is exact in float32, so the oracle and the kernels differ only in the
summation order of the dot.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.quant import codecs
from jaxspec.quant.formats import MX_BLOCK, mxfp4_dequantize

FORMATS = ("float", "fp8", "fp8_block", "mxfp4")
DEFAULT_BLOCK = (128, 128)


def check_inputs(
  x: Any, values: Any, scales: Any, fmt: str, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[int, int, int]:
  """Validates the operands' shapes and dtypes; returns (M, K, N). Raises ValueError."""
  if fmt not in FORMATS:
    raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
  if getattr(x, "ndim", None) != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float [M, K] array, got {getattr(x, 'shape', None)}")
  m, k = x.shape
  shape = tuple(values.shape)
  if fmt == "mxfp4":
    if len(shape) not in (3, 4) or shape[-1] != MX_BLOCK // 2 or values.dtype != jnp.uint8:
      raise ValueError(
        f"mxfp4 values must be uint8 [N, K/32, 16] or [G, N, K/G/32, 16], got {values.dtype}{shape}"
      )
    groups = shape[0] if len(shape) == 4 else 1
    n, kb = shape[-3], shape[-2]
    if groups * kb * MX_BLOCK != k:
      raise ValueError(f"x has K={k} but the mxfp4 weight holds K={groups * kb * MX_BLOCK}")
    if tuple(scales.shape) != shape[:-1] or scales.dtype != jnp.uint8:
      raise ValueError(
        f"mxfp4 scales must be uint8 {list(shape[:-1])}, got {scales.dtype}{tuple(scales.shape)}"
      )
    return m, k, n
  if len(shape) != 2:
    raise ValueError(f"{fmt} values must be a matrix, got shape {shape}")
  if fmt == "fp8_block":
    n, kw = shape
    bo, bi = block
    want = (-(-n // bo), -(-kw // bi))
    if tuple(scales.shape) != want:
      raise ValueError(f"fp8_block scales must be {want} for blocks {block}, got {scales.shape}")
  else:
    kw, n = shape
    if fmt == "fp8" and tuple(scales.shape) != (n,):
      raise ValueError(f"fp8 scales must be [N] = [{n}], got {tuple(scales.shape)}")
  if kw != k:
    raise ValueError(f"x has K={k} but the weight holds K={kw}")
  if fmt in ("fp8", "fp8_block") and values.dtype not in (jnp.uint8, codecs.FP8_DTYPE):
    raise ValueError(f"{fmt} values must be float8_e4m3fn or their uint8 bytes, got {values.dtype}")
  return m, k, n


def dequantize(
  values: jax.Array, scales: Any, fmt: str, block: tuple[int, int] = DEFAULT_BLOCK
) -> jax.Array:
  """The weight as float32 [K, N]."""
  if fmt == "float":
    return values.astype(jnp.float32)
  if fmt == "mxfp4":
    w = mxfp4_dequantize(values, scales, axis=-2, dtype=jnp.float32)  # [(G,) K/G, N]
    return w.reshape(-1, w.shape[-1])
  if values.dtype == jnp.uint8:
    values = codecs.fp8_values(values)
  if fmt == "fp8":
    return values.astype(jnp.float32) * scales.astype(jnp.float32)[None, :]
  n, k = values.shape
  bo, bi = block
  s = jnp.repeat(jnp.repeat(scales.astype(jnp.float32), bo, axis=0), bi, axis=1)[:n, :k]
  return (values.astype(jnp.float32) * s).T


@functools.partial(jax.jit, static_argnames=("fmt", "block"))
def qmatmul_reference(
  x: jax.Array,
  values: jax.Array,
  scales: Any,
  fmt: str,
  block: tuple[int, int] = DEFAULT_BLOCK,
) -> jax.Array:
  """x [M, K] @ dequantize(weight) [K, N] in float32 (see the module docstring)."""
  check_inputs(x, values, scales, fmt, block)
  w = dequantize(values, scales, fmt, block)
  return jnp.dot(x.astype(jnp.float32), w, precision=jax.lax.Precision.HIGHEST)
