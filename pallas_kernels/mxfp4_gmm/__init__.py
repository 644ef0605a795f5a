"""MXFP4 grouped expert matmul: rows of x grouped by expert times their expert's MXFP4 weight.

  mxfp4_gmm(x, values, scales, group_sizes, *, impl="auto", interpret=False,
            preferred_element_type=None, block_m=None, block_n=None, block_k=None)

x [M, K] (float32 or bfloat16) holds rows sorted by expert, group_sizes int32 [E] how many
consecutive rows each expert owns (zeros allowed; rows past the sum give 0); the [E, K, N]
expert stack is stored as `jaxspec.quant.formats` stores an MXFP4 expert weight with contraction
axis K (`QTensor(values, scales, "mxfp4", axes=(-2,))`): values uint8 [E, N, K/32, 16], scales
uint8 [E, N, K/32]. Returns [M, N] in preferred_element_type (else x's dtype): what
`jax.lax.ragged_dot(x, dequantize(W), group_sizes)` gives, the MoE ragged backend's product.

impl="xla" is reference.py (dequantize the whole stack, then ragged_dot); impl="pallas" runs
kernel_gpu.py (Triton-style: one program per (expert, column tile), masked row tiles, weights
dequantized tile by tile in registers) and impl="pallas_tpu" kernel_tpu.py (Mosaic-style,
megablox-like: scalar-prefetched visit list, VMEM accumulator), each in interpret mode when
`interpret` is set (for "pallas_tpu" it may also be a `pltpu.InterpretParams`; for "pallas"
any true value means interpret=True). "auto" picks "xla" on every backend: both kernels have so
far been checked only in interpret mode on CPU and by lowering (no GPU or TPU was available when
they were written), so they are opt-in until they have run on hardware. The point of the kernels
is the bytes: weights are read at 4.25 bits per weight and never materialized dequantized in HBM
(see each kernel's docstring).
"""

from __future__ import annotations

from typing import Any

import jax

from pallas_kernels.mxfp4_gmm.decode import dequantize_tile, mxfp4_to_f32
from pallas_kernels.mxfp4_gmm.kernel_gpu import mxfp4_gmm_gpu
from pallas_kernels.mxfp4_gmm.kernel_tpu import group_metadata, mxfp4_gmm_tpu
from pallas_kernels.mxfp4_gmm.reference import (
  check_inputs,
  dequantize_experts,
  mxfp4_gmm_reference,
)

IMPLS = ("auto", "xla", "pallas", "pallas_tpu")


def mxfp4_gmm(
  x: jax.Array,
  values: jax.Array,
  scales: jax.Array,
  group_sizes: jax.Array,
  *,
  impl: str = "auto",
  interpret: Any = False,
  preferred_element_type: Any = None,
  block_m: int | None = None,
  block_n: int | None = None,
  block_k: int | None = None,
) -> jax.Array:
  """[M, N] grouped matmul with MXFP4 expert weights; see reference.py for the contract.

  block_m / block_n / block_k (None: the kernel's default) only affect the Pallas impls, whose
  kernels have been checked in interpret mode only; "auto" resolves to "xla". Raises ValueError
  for an unknown impl and for operands that do not fit together (K not a multiple of 32, values
  and scales disagreeing, group_sizes not [E], storage not uint8).
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
  check_inputs(x, values, scales, group_sizes)
  blocks = {
    name: size
    for name, size in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k))
    if size is not None
  }
  if impl == "pallas":
    return mxfp4_gmm_gpu(
      x,
      values,
      scales,
      group_sizes,
      preferred_element_type=preferred_element_type,
      interpret=bool(interpret),
      **blocks,
    )
  if impl == "pallas_tpu":
    return mxfp4_gmm_tpu(
      x,
      values,
      scales,
      group_sizes,
      preferred_element_type=preferred_element_type,
      interpret=interpret,
      **blocks,
    )
  return mxfp4_gmm_reference(
    x, values, scales, group_sizes, preferred_element_type=preferred_element_type
  )


__all__ = [
  "IMPLS",
  "check_inputs",
  "dequantize_experts",
  "dequantize_tile",
  "group_metadata",
  "mxfp4_gmm",
  "mxfp4_gmm_gpu",
  "mxfp4_gmm_reference",
  "mxfp4_gmm_tpu",
  "mxfp4_to_f32",
]
