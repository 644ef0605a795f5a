"""Kernel or reference by the platform the program is lowered for (not the host's backend).

The model's Pallas options (attention_impl, gmm_impl, linear_attention_impl = "pallas") name
kernels written for one platform. Choosing by `jax.default_backend()` at trace time is wrong for
ahead-of-time lowering (`.lower(lowering_platforms=...)` from another host) and for a trace
reused on another backend, so the choice is staged out with `jax.lax.platform_dependent`: every
branch is traced, and lowering keeps the one of the target platform only.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax

T = TypeVar("T")


def kernel_or_reference(
  kernel: Callable[[bool], T],
  reference: Callable[[], T],
  tpu: Callable[[], T] | None = None,
) -> T:
  """The GPU kernel where it runs, else `tpu` on TPU, else the reference, chosen at lowering.

  kernel(interpret) is the GPU (Triton) kernel: interpret=True on CPU (a testing mode), False on
  CUDA and ROCm. `tpu` is the TPU kernel, if there is one; TPU and any other platform run
  `reference` otherwise.
  """
  gpu = lambda: kernel(False)  # one branch for both GPU platforms
  branches = dict(cpu=lambda: kernel(True), cuda=gpu, rocm=gpu)
  if tpu is not None:
    branches["tpu"] = tpu
  return jax.lax.platform_dependent(default=reference, **branches)
