"""Kernel or reference by the platform the program is lowered for (not the host's backend).

The model's Pallas options (attention_impl, gmm_impl, linear_attention_impl = "pallas") name
kernels written for one platform. Choosing by `jax.default_backend()` at trace time is wrong for
ahead-of-time lowering (`.lower(lowering_platforms=...)` from another host) and for a trace
reused on another backend, so the choice is staged out with `jax.lax.platform_dependent`: every
branch is traced, and lowering keeps the one of the target platform only.

Because every branch is traced on every host, a kernel that refuses the shapes for its platform
(e.g. the Triton kernels' power-of-two widths, checked only when not in interpret mode) must not
fail the trace for the others: its branch then raises the kernel's error when, and only when, it
is lowered.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import jax
from jax.extend.core import Primitive
from jax.interpreters import mlir

T = TypeVar("T")

_refused_p = Primitive("jaxspec_kernel_refused")
_refused_p.multiple_results = True
_refused_p.def_abstract_eval(lambda *, avals, message: list(avals))


def _refused_lowering(ctx, *, avals, message):
  del ctx, avals
  raise ValueError(message)


mlir.register_lowering(_refused_p, _refused_lowering)


def _or_refusal(branch: Callable[[], T], reference: Callable[[], T], where: str) -> Callable[[], T]:
  """`branch`, or, if tracing it raises ValueError / NotImplementedError, values shaped as
  `reference`'s whose lowering raises that error."""

  def run() -> T:
    try:
      return branch()
    except (ValueError, NotImplementedError) as e:
      leaves, tree = jax.tree.flatten(reference())
      avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
      message = f"the Pallas kernel for {where} refuses these operands: {e}"
      return jax.tree.unflatten(tree, _refused_p.bind(avals=avals, message=message))

  return run


def kernel_or_reference(
  kernel: Callable[[bool], T],
  reference: Callable[[], T],
  tpu: Callable[[], T] | None = None,
) -> T:
  """The GPU kernel where it runs, else `tpu` on TPU, else the reference, chosen at lowering.

  kernel(interpret) is the GPU (Triton) kernel: interpret=True on CPU (a testing mode), False on
  CUDA and ROCm. `tpu` is the TPU kernel, if there is one; TPU and any other platform run
  `reference` otherwise. A GPU or TPU kernel that refuses the operands raises when lowered for
  its platform, not when traced.
  """
  gpu = _or_refusal(lambda: kernel(False), reference, "GPUs")  # one branch for CUDA and ROCm
  branches = dict(cpu=lambda: kernel(True), cuda=gpu, rocm=gpu)
  if tpu is not None:
    branches["tpu"] = _or_refusal(tpu, reference, "TPU")
  return jax.lax.platform_dependent(default=reference, **branches)
