"""Pure-jnp oracle for the chunked gated delta rule: `gated_delta_reference` is
`jaxspec.models.gated_deltanet.chunked` (q, k, v, g, beta, state=None, chunk_size=64) →
(out [B, T, H, Dv] float32, final state [B, H, Dk, Dv]).

The kernel (kernel_gpu.py) computes the same chunk-wise UT-transform math as `chunked`, so the
oracle is that function itself, and `recurrent_reference` (one token at a time) is the second,
independent oracle the tests also check against. The math is not repeated here. (The model
imports this package lazily, inside the function that dispatches to it, so this import of the
model code makes no cycle.)
"""

from __future__ import annotations

from jaxspec.models.gated_deltanet import chunked as gated_delta_reference
from jaxspec.models.gated_deltanet import recurrent_reference

__all__ = ["gated_delta_reference", "recurrent_reference"]
