"""Pure-jnp oracle for the chunked gated delta rule: `jaxspec.models.gated_deltanet.chunked`.

The kernel (kernel_gpu.py) computes the same chunk-wise UT-transform math as `chunked`, so the
oracle is that function itself, and `recurrent_reference` (one token at a time) is the second,
independent oracle the tests also check against. The math is not repeated here. (The model
imports this package lazily, inside the function that dispatches to it, so this import of the
model code makes no cycle.)
"""

from __future__ import annotations

import jax

from jaxspec.models.gated_deltanet import chunked, recurrent_reference


def gated_delta_reference(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
  chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
  """(out [B, T, H, Dv] float32, final state [B, H, Dk, Dv]): `gated_deltanet.chunked`."""
  return chunked(q, k, v, g, beta, state, chunk_size)


__all__ = ["gated_delta_reference", "recurrent_reference"]
