"""Pure-jnp oracle for the MXFP4 grouped matmul: dequantize the experts, then `ragged_dot`.

  y[m, :] = x[m, :] @ W[g(m)]          (rows grouped consecutively by expert)

x is [M, K]; W is the [E, K, N] expert stack stored in MXFP4 as `jaxspec.quant.formats` stores
an expert weight whose contraction axis is K (axes=(-2,)): the K axis moved last and cut into
blocks of 32, `values` uint8 [E, N, K/32, 16] (two E2M1 codes per byte, the even element in the
low nibble) and `scales` uint8 [E, N, K/32] (E8M0, 2^(s − 127)). `group_sizes` int32 [E] says how
many consecutive rows of x belong to each expert (zeros allowed); rows past sum(group_sizes) give
0, as `jax.lax.ragged_dot` does. This is exactly what the MoE ragged backend
(`jaxspec.models.moe.experts_ragged`) computes for a quantized expert weight, and it is the XLA
path of `mxfp4_gmm` (impl="xla"). The dequantization is `jaxspec.quant.formats.mxfp4_dequantize`
itself, so the oracle cannot drift from the storage format.

The dequantized weights are exact in float32 and bfloat16 (an E2M1 value times a power of two),
so the oracle and the kernels differ only in the summation order of the dot.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.quant.formats import MX_BLOCK, mxfp4_dequantize

PACKED = MX_BLOCK // 2  # bytes per 32-element block


def check_inputs(x: Any, values: Any, scales: Any, group_sizes: Any) -> tuple[int, int, int, int]:
  """Validates the operands' shapes and dtypes; returns (M, K, N, E). Raises ValueError."""
  if getattr(x, "ndim", None) != 2:
    raise ValueError(f"x must be [M, K], got shape {getattr(x, 'shape', None)}")
  m, k = x.shape
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a float array, got {x.dtype}")
  if getattr(values, "ndim", None) != 4 or values.shape[-1] != PACKED:
    raise ValueError(
      f"values must be uint8 [E, N, K/32, {PACKED}] (MXFP4, contraction axis last), got shape "
      f"{getattr(values, 'shape', None)}"
    )
  if values.dtype != jnp.uint8 or getattr(scales, "dtype", None) != jnp.uint8:
    raise ValueError(
      f"MXFP4 storage must be uint8, got values {values.dtype} and scales "
      f"{getattr(scales, 'dtype', None)}"
    )
  e, n, n_blocks, _ = values.shape
  if tuple(scales.shape) != (e, n, n_blocks):
    raise ValueError(f"scales {tuple(scales.shape)} do not match values {tuple(values.shape)}")
  if k % MX_BLOCK:
    raise ValueError(f"K={k} is not a multiple of the MXFP4 block ({MX_BLOCK})")
  if k != n_blocks * MX_BLOCK:
    raise ValueError(f"x has K={k} but the weights hold K={n_blocks * MX_BLOCK}")
  if getattr(group_sizes, "shape", None) != (e,):
    raise ValueError(
      f"group_sizes must be [E] = [{e}], got shape {getattr(group_sizes, 'shape', None)}"
    )
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise ValueError(f"group_sizes must be integer, got {group_sizes.dtype}")
  return m, k, n, e


def out_dtype(x: jax.Array, preferred_element_type: Any) -> np.dtype:
  return jnp.dtype(x.dtype if preferred_element_type is None else preferred_element_type)


def dequantize_experts(values: jax.Array, scales: jax.Array, dtype: Any) -> jax.Array:
  """[E, N, K/32, 16] + [E, N, K/32] → the [E, K, N] expert stack (materialized)."""
  return mxfp4_dequantize(values, scales, axis=-2, dtype=dtype)


@functools.partial(jax.jit, static_argnames=("preferred_element_type",))
def mxfp4_gmm_reference(
  x: jax.Array,
  values: jax.Array,
  scales: jax.Array,
  group_sizes: jax.Array,
  *,
  preferred_element_type: Any = None,
) -> jax.Array:
  """[M, N]: row m of x times its group's dequantized expert; rows past sum(group_sizes) are 0.

  Materializes the whole [E, K, N] expert stack in x.dtype (that is what the kernels avoid).
  Output dtype: preferred_element_type, else x.dtype.
  """
  check_inputs(x, values, scales, group_sizes)
  w = dequantize_experts(values, scales, x.dtype)
  return jax.lax.ragged_dot(
    x,
    w,
    group_sizes.astype(jnp.int32),
    preferred_element_type=out_dtype(x, preferred_element_type),
  )
