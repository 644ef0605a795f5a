"""Pure-jnp oracle for tree attention: a verify block over the KV prefix plus itself.

Computes exactly what the decoder's XLA path computes (`jaxspec.models.layers.block_visibility`
followed by `gqa_attention`): query t of the block written at cache slots start..start+T-1 sees
every slot before `start` (the committed prefix) and block slot start+u iff block_mask[t, u]
(for tree verification: u is an ancestor of t, or t itself; `block_mask=None` is causal inside
the block, u <= t). It also takes the kernel's optional inputs (a stacked [L, B, S, K, D] cache
with a `layer` index, FP8 K/V with per-slot float32 scales) so that it stays the kernel's oracle.
Kept self-contained (no import of the model code) so that the model may later dispatch to this
package without an import cycle.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # large finite negative (as the model code): fully masked rows stay NaN-free


def causal_mask(block_len: int) -> jax.Array:
  """[T, T] bool lower-triangular mask: query t sees block tokens u <= t."""
  return jnp.tril(jnp.ones((block_len, block_len), bool))


def visibility(
  start: jax.Array, block_len: int, cache_len: int, block_mask: jax.Array | None
) -> jax.Array:
  """[B, T, S] bool: which cache slots each block query may read (None mask: causal)."""
  batch = start.shape[0]
  if block_mask is None:
    block_mask = causal_mask(block_len)
  if block_mask.ndim == 2:
    block_mask = jnp.broadcast_to(block_mask, (batch, block_len, block_len))
  rel = jnp.arange(cache_len)[None, :] - start[:, None]  # [B, S]
  in_block = (rel >= 0) & (rel < block_len)
  idx = jnp.broadcast_to(jnp.clip(rel, 0, block_len - 1)[:, None, :], (batch, block_len, cache_len))
  inside = jnp.take_along_axis(block_mask.astype(bool), idx, axis=2)
  return (rel < 0)[:, None, :] | (in_block[:, None, :] & inside)


def select_layer(x: jax.Array, layer: jax.Array | int | None, ndim: int, name: str) -> jax.Array:
  """One layer of a stacked cache: `x` has rank `ndim` (one layer) or ndim + 1 ([L, ...]).

  `layer` is required exactly when `x` is stacked; it is clamped into [0, L) (as the kernel does).
  """
  if x.ndim == ndim:
    if layer is not None:
      raise ValueError(f"layer given but {name} has rank {ndim} (a single layer)")
    return x
  if x.ndim != ndim + 1:
    raise ValueError(f"{name} has rank {x.ndim}; expected {ndim} or {ndim + 1} (stacked)")
  if layer is None:
    raise ValueError(f"{name} is a stacked [L, ...] cache: pass layer=")
  layer = jnp.clip(jnp.asarray(layer, jnp.int32), 0, x.shape[0] - 1)
  return jax.lax.dynamic_index_in_dim(x, layer, 0, keepdims=False)


def dequantize(x: jax.Array, x_scale: jax.Array | None) -> jax.Array:
  """x.astype(f32) * x_scale[..., None] (per-slot, per-KV-head scale); x itself without scale."""
  if x_scale is None:
    return x
  return x.astype(jnp.float32) * x_scale.astype(jnp.float32)[..., None]


@jax.jit
def tree_attention_reference(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  start: jax.Array,
  block_mask: jax.Array | None,
  scale: float | None = None,
  *,
  layer: jax.Array | int | None = None,
  k_scale: jax.Array | None = None,
  v_scale: jax.Array | None = None,
) -> jax.Array:
  """Attention of the block's queries over prefix + block (ancestor mask inside the block).

  Args:
    q: [B, T, H, D] queries of the T block tokens (RoPE applied).
    k, v: [B, S, K, D] one layer's cache, or [L, B, S, K, D] the stacked cache of all layers
      (then `layer` selects one), the block's own K/V already written at slots
      start..start+T-1; H must be a multiple of K (grouped-query attention).
    start: [B] int32 first block slot per sequence (= committed prefix length).
    block_mask: [T, T] or [B, T, T] bool, mask[t, u]: query t sees block token u; None: causal
      (u <= t).
    scale: softmax scale; default D ** -0.5.
    layer: int32 scalar (may be traced), required iff k/v are stacked; clamped into [0, L).
    k_scale, v_scale: optional float32 [B, S, K] (or [L, B, S, K]) dequantization scales: the
      slot's value is k.astype(f32) * k_scale[..., None] (k/v typically float8_e4m3fn).

  Returns:
    [B, T, H, D] in q's dtype (scores and softmax in float32).
  """
  b, t, h, d = q.shape
  k = dequantize(
    select_layer(k, layer, 4, "k"),
    None if k_scale is None else select_layer(k_scale, layer, 3, "k_scale"),
  )
  v = dequantize(
    select_layer(v, layer, 4, "v"),
    None if v_scale is None else select_layer(v_scale, layer, 3, "v_scale"),
  )
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


def gather_pages(pool: jax.Array, page_table: jax.Array, stacked: bool) -> jax.Array:
  """A paged pool [L, P, page, ...] (stacked; else [P, page, ...]) as the contiguous cache its
  page table [B, W] describes: [L, B, W · page, ...] (or [B, W · page, ...]); unmapped ids
  (≥ P) read zeros. The reference the paged kernel is checked against."""
  axis = int(stacked)
  pages = jnp.take(pool, page_table, axis=axis, mode="fill", fill_value=0)  # [.., B, W, page, ..]
  return pages.reshape(pages.shape[: axis + 1] + (-1,) + pages.shape[axis + 3 :])
