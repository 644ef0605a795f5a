"""Pure-jnp oracle for tree attention: a verify block over the KV prefix plus itself.

Computes exactly what the decoder's XLA path computes (`jaxspec.models.layers.block_visibility`
followed by `gqa_attention`): query t of the block written at cache slots start..start+T-1 sees
every slot before `start` (the committed prefix) and block slot start+u iff block_mask[t, u]
(for tree verification: u is an ancestor of t, or t itself). Kept self-contained (no import of
the model code) so that the model may later dispatch to this package without an import cycle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # large finite negative (as the model code): fully masked rows stay NaN-free


def visibility(
  start: jax.Array, block_len: int, cache_len: int, block_mask: jax.Array
) -> jax.Array:
  """[B, T, S] bool: which cache slots each block query may read."""
  batch = start.shape[0]
  if block_mask.ndim == 2:
    block_mask = jnp.broadcast_to(block_mask, (batch, block_len, block_len))
  rel = jnp.arange(cache_len)[None, :] - start[:, None]  # [B, S]
  in_block = (rel >= 0) & (rel < block_len)
  idx = jnp.broadcast_to(jnp.clip(rel, 0, block_len - 1)[:, None, :], (batch, block_len, cache_len))
  inside = jnp.take_along_axis(block_mask.astype(bool), idx, axis=2)
  return (rel < 0)[:, None, :] | (in_block[:, None, :] & inside)


def tree_attention_reference(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array,
  scale: float | None = None,
) -> jax.Array:
  """Attention of the block's queries over prefix + block (ancestor mask inside the block).

  Args:
    q: [B, T, H, D] queries of the T block tokens (RoPE applied).
    k, v: [B, S, K, D] one layer's cache, the block's own K/V already written at
      slots start..start+T-1; H must be a multiple of K (grouped-query attention).
    start: [B] int32 first block slot per sequence (= committed prefix length).
    block_mask: [T, T] or [B, T, T] bool, mask[t, u]: query t sees block token u.
    scale: softmax scale; default D ** -0.5.

  Returns:
    [B, T, H, D] in q's dtype (scores and softmax in float32).
  """
  b, t, h, d = q.shape
  kv_heads = k.shape[2]
  scale = d**-0.5 if scale is None else scale
  visible = visibility(start, t, k.shape[1], block_mask)
  qg = q.reshape(b, t, kv_heads, h // kv_heads, d)
  scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
  scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum(
    "bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, t, h, d).astype(q.dtype)
