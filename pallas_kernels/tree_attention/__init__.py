"""Tree attention: a verify block's queries over the per-sequence KV prefix plus the block itself
under an ancestor-only mask (DDTree / EAGLE tree verification).

  tree_attention(q, k, v, start, block_mask, scale=None, impl="auto", interpret=False,
                 block_k=64, *, layer=None, k_scale=None, v_scale=None, num_splits=None,
                 page_table=None)

k, v may be one layer's cache [B, S, K, D] or the stacked cache [L, B, S, K, D] with a (traced)
int32 `layer`; optional float32 k_scale / v_scale ([B, S, K] or [L, B, S, K]) dequantize an
FP8 (float8_e4m3fn) cache; block_mask is [T, T], [B, T, T] or None (causal in the block).
With `page_table` [B, W] k, v (and the scales) are page pools [L, P, page, K, D]: sequence b's
logical slot s is slot s mod page of pool page page_table[b, s // page] (jaxspec's PagedKV);
the reference gathers them into a contiguous cache (`gather_pages`), the kernel reads the
pages in place.

impl="xla" is the pure-jnp reference (reference.py), which is also what the decoder's XLA path
computes; impl="pallas" runs kernel_gpu.py (GQA-grouped flash-decoding: one program per
(sequence, KV head, KV split), online softmax over KV tiles, log-sum-exp merge of the splits),
in interpret mode when `interpret=True`. "auto" picks "xla": the Pallas kernel has so far been
checked only in interpret mode (no GPU was available when it was written), so it is opt-in until
it has run on hardware. There is no TPU kernel yet.
"""

from __future__ import annotations

import jax

from pallas_kernels.tree_attention.kernel_gpu import (
  DEFAULT_SPLIT_LEN,
  choose_num_splits,
  combine_splits,
  tree_attention_pallas,
  tree_attention_partials,
)
from pallas_kernels.tree_attention.reference import (
  causal_mask,
  gather_pages,
  tree_attention_reference,
  visibility,
)

IMPLS = ("auto", "xla", "pallas")


def tree_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float | None = None,
  impl: str = "auto",
  interpret: bool = False,
  block_k: int = 64,
  *,
  layer: jax.Array | int | None = None,
  k_scale: jax.Array | None = None,
  v_scale: jax.Array | None = None,
  num_splits: int | None = None,
  page_table: jax.Array | None = None,
) -> jax.Array:
  """[B, T, H, D] attention of the block over prefix + block; see reference.py for the contract.

  `block_k` and `num_splits` (None: ceil(S / 512)) only affect impl="pallas", whose kernel has
  been checked in interpret mode only; "auto" resolves to "xla".
  """
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r}; expected one of {IMPLS}")
  if impl == "pallas":
    return tree_attention_pallas(
      q,
      k,
      v,
      start,
      block_mask,
      scale,
      block_k=block_k,
      interpret=interpret,
      layer=layer,
      k_scale=k_scale,
      v_scale=v_scale,
      num_splits=num_splits,
      page_table=page_table,
    )
  if page_table is not None:
    stacked = layer is not None
    k, v = gather_pages(k, page_table, stacked), gather_pages(v, page_table, stacked)
    k_scale, v_scale = (
      None if x is None else gather_pages(x, page_table, stacked) for x in (k_scale, v_scale)
    )
  return tree_attention_reference(
    q, k, v, start, block_mask, scale, layer=layer, k_scale=k_scale, v_scale=v_scale
  )


__all__ = [
  "DEFAULT_SPLIT_LEN",
  "causal_mask",
  "gather_pages",
  "choose_num_splits",
  "combine_splits",
  "tree_attention",
  "tree_attention_pallas",
  "tree_attention_partials",
  "tree_attention_reference",
  "visibility",
]
