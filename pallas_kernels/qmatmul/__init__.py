"""Dense quantized matmul: x [M, K] times a float, FP8 or MXFP4 weight, reading the stored bytes.

  qmatmul(x, values, scales, fmt, *, block=(128, 128), impl="auto", interpret=False)

The formats and layouts are reference.py's. Returns float32 [M, N].

impl="xla" is reference.py (dequantize the whole weight, then one dot). impl="cpu" is the C++
kernel of kernel_cpu.cc, called through the XLA FFI. impl="pallas" is kernel_gpu.py and
impl="pallas_tpu" kernel_tpu.py (interpret mode when `interpret` is set). "auto" chooses per
platform inside the compiled program (`jax.lax.platform_dependent`).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.qmatmul.kernel_gpu import qmatmul_gpu
from pallas_kernels.qmatmul.kernel_tpu import qmatmul_tpu
from pallas_kernels.qmatmul.reference import (
  DEFAULT_BLOCK,
  FORMATS,
  check_inputs,
  dequantize,
  qmatmul_reference,
)

IMPLS = ("auto", "xla", "cpu", "pallas", "pallas_tpu")


def qmatmul(
  x: jax.Array,
  values: jax.Array,
  scales: Any,
  fmt: str,
  *,
  block: tuple[int, int] = DEFAULT_BLOCK,
  impl: str = "auto",
  interpret: bool = False,
) -> jax.Array:
  """x [M, K] @ the stored weight, float32 [M, N] (see the module docstring)."""
  if impl not in IMPLS:
    raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
  check_inputs(x, values, scales, fmt, block)
  if impl == "pallas":
    return qmatmul_gpu(x, values, scales, fmt, block, interpret)
  if impl == "pallas_tpu":
    return qmatmul_tpu(x, values, scales, fmt, block, interpret)
  return qmatmul_reference(x, values, scales, fmt, block)


__all__ = [
  "DEFAULT_BLOCK",
  "FORMATS",
  "IMPLS",
  "check_inputs",
  "dequantize",
  "qmatmul",
  "qmatmul_gpu",
  "qmatmul_reference",
  "qmatmul_tpu",
]
