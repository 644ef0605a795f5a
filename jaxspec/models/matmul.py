"""x times a stored weight (float or `jaxspec.quant.QTensor`), by the kernel that reads its bytes.

`dense(x, w, in_dims, dtype)` is what `layers.Dense` computes: x's last `in_dims` axes contracted
with w's first `in_dims` axes. When the product is a decode or verify block on a CPU and the
weight's layout has a kernel (`kernel_operands`), it goes to `pallas_kernels.qmatmul`, which
multiplies the stored bytes (FP8, MXFP4, or float32) without materializing a float copy of the
weight; otherwise to XLA, dequantizing first (`jaxspec.quant.materialize`), as before.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.quant import is_quantized, materialize

# pallas_kernels.qmatmul builds on jaxspec.quant, and importing it first imports jaxspec, which
# imports this module: it is imported where it is used.


def kernel_operands(w: Any, in_dims: int) -> tuple | None:
  """(values, scales, format, block) in `qmatmul`'s layouts for a weight [*in, *out] whose first
  `in_dims` axes are contracted, or None when no kernel reads this layout (XLA does)."""
  from pallas_kernels.qmatmul import DEFAULT_BLOCK  # pylint: disable=import-outside-toplevel

  if not is_quantized(w):
    k = math.prod(w.shape[:in_dims])
    return w.reshape(k, -1), None, "float", DEFAULT_BLOCK
  shape = w.shape
  ndim = len(shape)
  k, n = math.prod(shape[:in_dims]), math.prod(shape[in_dims:])
  if w.format == "fp8_block":
    kind, _, block = w.layout
    if kind not in ("linear", "in_heads", "out_heads") or tuple(w.values.shape) != (n, k):
      return None
    return w.values, w.scales, "fp8_block", tuple(block)
  if tuple(w.axes) != tuple(range(-ndim, -ndim + in_dims)):
    return None  # contraction axes other than the leading ones (not a Dense weight)
  if w.format == "fp8":
    return w.values.reshape(k, n), w.scales.reshape(n), "fp8", DEFAULT_BLOCK
  if w.format == "mxfp4":
    # The last contraction axis was moved last and blocked: [*in[:-1], *out, blocks, 16].
    groups = math.prod(shape[: in_dims - 1])
    blocks = w.values.shape[-2]
    values = w.values.reshape(groups, n, blocks, w.values.shape[-1])
    scales = w.scales.reshape(groups, n, blocks)
    if groups == 1:
      values, scales = values[0], scales[0]
    return values, scales, "mxfp4", DEFAULT_BLOCK
  return None


def dense(x: jax.Array, w: Any, in_dims: int, dtype: Any) -> jax.Array:
  """x [..., *in] @ w [*in, *out] → [..., *out] in `dtype` (float32 accumulation)."""
  lead, in_shape = x.shape[: x.ndim - in_dims], x.shape[x.ndim - in_dims :]
  out_shape = tuple(w.shape[in_dims:])
  from pallas_kernels import qmatmul as kernels  # pylint: disable=import-outside-toplevel

  operands = kernel_operands(w, in_dims)
  rows = math.prod(lead)
  if operands is not None and (is_quantized(w) or dtype == jnp.float32):
    x2 = x.reshape(rows, math.prod(in_shape))
    values, scales, fmt, block = operands
    if kernels.cpu_kernel_applies(x2, values, fmt):
      y = kernels.qmatmul(x2, values, scales, fmt, block=block)
      return y.reshape(*lead, *out_shape).astype(dtype)
  y = jax.lax.dot_general(
    x.astype(dtype),
    materialize(w, dtype),
    ((tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims))), ((), ())),
    preferred_element_type=jnp.float32 if dtype == jnp.float32 else None,
  )
  return y
