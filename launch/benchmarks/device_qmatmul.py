"""`bench.py device`, section "qmatmul" (quantized matmuls): pallas_kernels.qmatmul timed.

For each weight format (float, fp8, fp8_block, mxfp4) and M rows of x, one row per impl:
impl="xla" (dequantize, then one dot) and the platform's Pallas kernel ("pallas" on GPU,
"pallas_tpu" on TPU), each with its time (µs) and effective bandwidth (the weight's stored
bytes / time, GB/s); a kernel's row also compares its result with the xla one. The kernels have
never run on hardware: an error is caught and its text reported in the row (a kernel not
written yet, NotImplementedError, is a "skip"; any other error or a mismatch is a "fail").

On the device the weight is K × N = 4096 × 14336 (Llama-3-8B's up projection); the CPU smoke run
uses a tiny one, the GPU kernel in interpret mode and the CPU impl.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.profiling import roofline
from launch.benchmarks import device_checks as checks

FORMATS = ("float", "fp8", "fp8_block", "mxfp4")


@dataclasses.dataclass(frozen=True)
class QmatmulSizes:
  """The weight [K, N], the row counts, the activations' dtype, the timing repeats."""

  k: int
  n: int
  rows: tuple[int, ...]
  dtype: str
  repeats: int
  tolerance: float  # largest ‖kernel − xla‖ / ‖xla‖


DEVICE = QmatmulSizes(4096, 14336, (1, 4, 16, 32), "bfloat16", 20, 1e-2)
CPU = QmatmulSizes(256, 512, (1, 4), "float32", 3, 1e-5)


def kernel_impls(backend: str) -> tuple[tuple[str, bool], ...]:
  """(impl, interpret) of the kernels to check beside "xla" on `backend`."""
  if backend == "gpu":
    return (("pallas", False),)
  if backend == "tpu":
    return (("pallas_tpu", False),)
  return (("pallas", True), ("cpu", False))


def quantized_operands(w: jax.Array, fmt: str, block: tuple[int, int]) -> tuple[Any, Any]:
  """(values, scales) of the float weight w [K, N] in `fmt`, laid out as qmatmul reads them."""
  # pylint: disable=import-outside-toplevel
  from jaxspec.quant import codecs
  from jaxspec.quant.formats import quantize_weight

  if fmt == "float":
    return w, None
  if fmt in ("fp8", "mxfp4"):
    q = quantize_weight(w, fmt, (-2,))  # fp8: [K, N] + [N]; mxfp4: [N, K/32, 16] + [N, K/32]
    return q.values, q.scales
  # fp8_block: HF's [out, in] = [N, K] E4M3 with one scale per 128 × 128 block.
  wt = w.T.astype(jnp.float32)
  (n, k), (bo, bi) = wt.shape, block
  blocks = wt.reshape(n // bo, bo, k // bi, bi)
  scales = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(1, 3)), 1e-12) / 448.0
  values = (blocks / scales[:, None, :, None]).reshape(n, k).astype(codecs.FP8_DTYPE)
  return values, scales


def _stored_bytes(values: Any, scales: Any) -> int:
  return sum(int(a.size) * a.dtype.itemsize for a in (values, scales) if a is not None)


def section_qmatmul(rec: checks.Recorder, sizes: checks.Sizes, cpu: bool) -> None:
  """The section: every format × rows × impl as a row (see the module docstring)."""
  # pylint: disable=import-outside-toplevel
  from pallas_kernels.qmatmul import DEFAULT_BLOCK, qmatmul

  del sizes
  qs = CPU if cpu else DEVICE
  backend = jax.default_backend()
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  w = 0.02 * jax.random.normal(kw, (qs.k, qs.n), jnp.float32)  # drawn on the device
  for fmt in FORMATS:
    values, scales = jax.jit(
      functools.partial(quantized_operands, fmt=fmt, block=DEFAULT_BLOCK)
    )(w.astype(qs.dtype) if fmt == "float" else w)
    stored = _stored_bytes(values, scales)
    for m in qs.rows:
      x = jax.random.normal(jax.random.fold_in(kx, m), (m, qs.k), jnp.float32).astype(qs.dtype)
      xla = jax.jit(functools.partial(qmatmul, fmt=fmt, impl="xla"))

      def timed(fn, x=x, values=values, scales=scales, stored=stored) -> dict:
        seconds = roofline.median_seconds(lambda: fn(x, values, scales), qs.repeats)
        return dict(us=1e6 * seconds, gb_s=stored / seconds / 1e9, stored_mb=stored / 1e6)

      rec.run(f"{fmt}/m{m}/xla", functools.partial(timed, xla))
      want = None
      for impl, interpret in kernel_impls(backend):
        kernel = jax.jit(
          functools.partial(qmatmul, fmt=fmt, impl=impl, interpret=interpret)
        )

        def check(kernel=kernel, xla=xla, x=x, values=values, scales=scales, timed=timed):
          nonlocal want
          if want is None:
            want = xla(x, values, scales)
          try:
            got = kernel(x, values, scales)
            jax.block_until_ready(got)
          except NotImplementedError as e:
            raise checks.SkipCheck(f"NotImplementedError: {e}") from None
          err, max_abs, nans = checks._rel_err(got, want)  # pylint: disable=protected-access
          numbers = dict(rel_err=err, max_abs=max_abs, nan=nans, tol=qs.tolerance)
          if nans or not err <= qs.tolerance:
            return "fail", numbers
          return "pass", {**timed(kernel), **numbers}

        rec.run(f"{fmt}/m{m}/{impl}{'-interpret' if interpret else ''}", check)


__all__ = ["CPU", "DEVICE", "FORMATS", "kernel_impls", "quantized_operands", "section_qmatmul"]
