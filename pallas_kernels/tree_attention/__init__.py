"""Tree attention: a verify block's queries over the per-sequence KV prefix plus the block itself
under an ancestor-only mask (DDTree / EAGLE tree verification).

  tree_attention(q, k, v, start, block_mask, scale=None, impl="auto", interpret=False)

impl="xla" is the pure-jnp reference (reference.py), which is also what the decoder's XLA path
computes; impl="pallas" runs kernel_gpu.py (online softmax over KV tiles), in interpret mode
when `interpret=True`. "auto" picks "xla": the Pallas kernel has so far been checked only in
interpret mode (no GPU was available when it was written), so it is opt-in until it has run on
hardware. There is no TPU kernel yet.
"""

from __future__ import annotations

import jax

from pallas_kernels.tree_attention.kernel_gpu import tree_attention_pallas
from pallas_kernels.tree_attention.reference import tree_attention_reference, visibility

IMPLS = ("auto", "xla", "pallas")


def tree_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array,
  scale: float | None = None,
  impl: str = "auto",
  interpret: bool = False,
  block_k: int = 64,
) -> jax.Array:
  """[B, T, H, D] attention of the block over prefix + block; see reference.py for the contract."""
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
  if impl == "pallas":
    return tree_attention_pallas(
      q, k, v, start, block_mask, scale, block_k=block_k, interpret=interpret
    )
  return tree_attention_reference(q, k, v, start, block_mask, scale)


__all__ = ["tree_attention", "tree_attention_pallas", "tree_attention_reference", "visibility"]
