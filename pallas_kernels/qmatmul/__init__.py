"""Dense quantized matmul: x [M, K] times a float, FP8 or MXFP4 weight, reading the stored bytes.

  qmatmul(x, values, scales, fmt, *, block=(128, 128), impl="auto", interpret=False)

The formats and layouts are reference.py's. Returns float32 [M, N].

impl="xla" is reference.py (dequantize the whole weight, then one dot). impl="cpu" is the C++
kernel of kernel_cpu.cc, called through the XLA FFI (cpu.py builds it on first use).
impl="pallas" is kernel_gpu.py and impl="pallas_tpu" kernel_tpu.py (interpret mode when
`interpret` is set).

"auto" chooses inside the compiled program, per platform (`jax.lax.platform_dependent`): on CPU
the C++ kernel for up to MAX_KERNEL_ROWS rows (decode and verify blocks; a float weight only in
float32) when it could be built, else the reference; on GPU and TPU the reference, until the
Pallas kernels have run on hardware (they have been checked in interpret mode and by lowering).
The kernel paths differentiate through the reference (a custom VJP), so training code may call
`qmatmul` too.

Every kernel accumulates each output in one fixed order whatever M is, so a row's result does not
depend on which other rows share the call: a verify block's rows equal one-row decode bit for
bit on the CPU kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels.qmatmul import cpu
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
MAX_KERNEL_ROWS = 32  # past this a prefill's rows go to XLA's GEMM


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def _differentiable(kernel: Any, x: jax.Array, values: jax.Array, scales: Any, fmt: str,
                    block: tuple[int, int]) -> jax.Array:
  return kernel(x, values, scales)


def _forward(kernel, x, values, scales, fmt, block):
  return kernel(x, values, scales), (x, values, scales)


def _backward(kernel, fmt, block, residuals, g):
  del kernel
  reference = functools.partial(qmatmul_reference, fmt=fmt, block=block)
  return jax.vjp(reference, *residuals)[1](g)


_differentiable.defvjp(_forward, _backward)


def cpu_kernel_applies(x: jax.Array, values: jax.Array, fmt: str) -> bool:
  """Whether "auto" sends this product to the CPU kernel when it runs on a CPU."""
  if x.shape[0] > MAX_KERNEL_ROWS or x.shape[0] == 0:
    return False
  if fmt == "float" and values.dtype != jnp.float32:
    return False
  return jax.default_backend() == "cpu" and cpu.available()


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
  if impl == "xla":
    return qmatmul_reference(x, values, scales, fmt, block)
  if impl in ("pallas", "pallas_tpu") and fmt == "mxfp4" and values.ndim == 4:
    raise ValueError("grouped MXFP4 weights [G, N, K/G/32, 16] have no Pallas kernel (impl='auto')")
  if impl == "pallas":
    return qmatmul_gpu(x, values, scales, fmt, block, interpret)
  if impl == "pallas_tpu":
    return qmatmul_tpu(x, values, scales, fmt, block, interpret)
  on_cpu = lambda x, v, s: cpu.qmatmul_cpu(x, v, s, fmt, block)
  if impl == "cpu":
    return _differentiable(on_cpu, x, values, scales, fmt, block)
  if not cpu_kernel_applies(x, values, fmt):
    return qmatmul_reference(x, values, scales, fmt, block)
  reference = lambda x, v, s: qmatmul_reference(x, v, s, fmt, block)
  chosen = lambda x, v, s: jax.lax.platform_dependent(x, v, s, cpu=on_cpu, default=reference)
  return _differentiable(chosen, x, values, scales, fmt, block)


__all__ = [
  "DEFAULT_BLOCK",
  "FORMATS",
  "IMPLS",
  "MAX_KERNEL_ROWS",
  "check_inputs",
  "cpu_kernel_applies",
  "dequantize",
  "qmatmul",
  "qmatmul_gpu",
  "qmatmul_reference",
  "qmatmul_tpu",
]
