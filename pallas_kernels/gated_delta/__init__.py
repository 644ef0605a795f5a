"""The chunked gated delta rule (Gated DeltaNet's prefill / long-block form).

  gated_delta_rule(q, k, v, g, beta, state=None, chunk_size=64, impl="auto", interpret=False,
                   block_v=None)

q, k [B, T, H, Dk] (L2-normalised, scaled and repeated to the value heads), v [B, T, H, Dv],
log-decays g ≤ 0 and write strengths β [B, T, H], an initial state [B, H, Dk, Dv] (None:
zeros); returns (out [B, T, H, Dv] float32, final state [B, H, Dk, Dv] float32), as
`reference.chunked` (the model's XLA path) does.

impl="xla" is reference.py (`chunked`, a `lax.scan` over chunks); impl="pallas"
runs kernel_gpu.py (one program per (sequence, value head, value block), the chunks walked in
order inside the kernel with the state carried in float32), in interpret mode when
`interpret=True`. "auto" picks "xla": the kernel has been checked in interpret mode and by
lowering for CUDA only (no GPU was available when it was written), so it is opt-in until it has
run on hardware. There is no TPU kernel yet.
"""

from __future__ import annotations

import jax

from pallas_kernels.gated_delta.kernel_gpu import gated_delta_pallas
from pallas_kernels.gated_delta.reference import gated_delta_reference, recurrent_reference

IMPLS = ("auto", "xla", "pallas")


def gated_delta_rule(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
  chunk_size: int = 64,
  impl: str = "auto",
  interpret: bool = False,
  block_v: int | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(out, final state) of the chunked rule; see the module docstring for the contract.

  `block_v` only affects impl="pallas", whose kernel has been checked in interpret mode only;
  "auto" resolves to "xla".
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
  if impl == "pallas":
    return gated_delta_pallas(
      q, k, v, g, beta, state, chunk_size=chunk_size, block_v=block_v, interpret=interpret
    )
  return gated_delta_reference(q, k, v, g, beta, state, chunk_size)


__all__ = [
  "IMPLS",
  "gated_delta_pallas",
  "gated_delta_reference",
  "gated_delta_rule",
  "recurrent_reference",
]
