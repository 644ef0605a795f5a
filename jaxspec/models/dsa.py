"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2, GLM-5 `glm_moe_dsa`).

Each query keeps only the `index_topk` keys its indexer scores highest; the MLA attention of a
DSA layer then attends to those alone. The indexer scores key s for query t as

  score[t, s] = Σ_h w[t, h] · relu(q[t, h] · k[s]) · index_head_dim^-½,
  w = weights_proj(x) · index_n_heads^-½,

with q = wq_b(q_resid) per head (q_resid: MLA's q low-rank latent after q_a_layernorm) and one
shared key k = LayerNorm(wk(x)) per token. RoPE rotates the FIRST qk_rope_head_dim features of
q and k (MLA's query puts its RoPE part last): interleaved pairs for GLM-5, half-split for
DeepSeek-V3.2 (`ModelConfig.indexer_rope_interleave`). Scores are float32; a query chooses only
among keys it may see, so causal and tree masks apply before the top-k, and it keeps every key
it sees when it sees at most `index_topk`.

Exact ties are common: a key whose q·k is negative for every head scores exactly 0, and with
few heads several keys of a query tie at the top-k boundary. The published code leaves that
choice to torch.topk; here the EARLIER key wins (lax.top_k keeps the lower index, and keys are
laid out in position order: committed slots, then the block, whose tree nodes follow their
ancestors), so a query's choice never depends on later tokens. tests/test_dsa_reference.py
checks this against a numpy reference, and why transformers differs there.

Cost with a decoding state: every call scores the block's T queries against all `max_len` slots
of the layer's `IndexerKeys` (an [B, T, max_len] float32 score array and a top-k over max_len +
T entries per query), independent of the live length. The index keys are small (one
index_head_dim vector per token, no heads), so this stays cheap beside attention over the
latent cache, but it is sized by max_len, not by the committed length.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models.attention import Selection, block_visibility
from jaxspec.models.layers import Dense, apply_rope, dtype_of

K_NORM_EPS = 1e-6  # the indexer's key LayerNorm (transformers' default, not rms_norm_eps)


def select_topk(scores: jax.Array, visible: jax.Array, k: int) -> jax.Array:
  """bool [..., N]: the min(k, N) highest `scores` [..., N] among the `visible` entries.

  Invisible entries are never kept; a row with at most k visible entries keeps all of them.
  On equal scores the lower index wins.
  """
  n = scores.shape[-1]
  k = min(k, n)
  visible = jnp.broadcast_to(visible, scores.shape)
  masked = jnp.where(visible, scores.astype(jnp.float32), -jnp.inf)
  _, idx = jax.lax.top_k(masked, k)  # [..., k]
  lead = scores.shape[:-1]
  rows = idx.reshape(-1, k)
  kept = jnp.zeros((rows.shape[0], n), bool)
  kept = kept.at[jnp.arange(rows.shape[0])[:, None], rows].set(True)
  return kept.reshape(*lead, n) & visible


class LayerNorm(nn.Module):
  """y = (x − mean) / sqrt(var + eps) · scale + bias over the last axis, in float32."""

  dim: int
  eps: float
  axis_name: str = "head_dim"
  param_dtype: str = "float32"

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    dt = dtype_of(self.param_dtype)
    part = lambda init: nn.with_logical_partitioning(init, (self.axis_name,))
    scale = self.param("scale", part(nn.initializers.ones), (self.dim,), dt)
    bias = self.param("bias", part(nn.initializers.zeros), (self.dim,), dt)
    xf = x.astype(jnp.float32)
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    centred = xf - mean
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    y = centred * jax.lax.rsqrt(var + self.eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


class Indexer(nn.Module):
  """The lightning indexer of one DSA layer; parameters named as in the HF checkpoint
  (`wq_b`, `wk`, `k_norm`, `weights_proj`), so a loader maps them one to one.

  Call: (x [B, T, hidden], q_resid [B, T, q_lora_rank], cos, sin [B, T, qk_rope_head_dim] (the
  RoPE tables MLA uses), keys: IndexerKeys or None, layer, start [B] int32, block_mask [T, T]
  bool or None) → (Selection, keys).

  Query t of row b sees the committed slots s < start[b] and the block keys u with
  block_mask[t, u] (causal when None; a tree's ancestor mask in verification, so a node chooses
  among the prefix and its own ancestors only). The block's keys are written at slots
  start..start+T−1 first (so later steps read them); the block scores them as stored. Without
  a state (training, full sequences) the block is the whole sequence and `Selection.cache` is
  None. The float32 scores [B, T, S + T] are sown as intermediates "index_scores" (read them
  with `mutable=["intermediates"]`; a no-op otherwise).
  """

  config: ModelConfig

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    q_resid: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    keys: Any,
    layer: jax.Array,
    start: jax.Array,
    block_mask: jax.Array | None = None,
  ) -> tuple[Selection, Any]:
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    heads, dim = c.index_n_heads, c.index_head_dim
    batch, t = x.shape[:2]
    q = Dense((heads, dim), ("q_lora", "heads", "head_dim"), name="wq_b", **dense)(q_resid)
    k = Dense((dim,), ("embed", "head_dim"), name="wk", **dense)(x)
    k = LayerNorm(dim, K_NORM_EPS, "head_dim", c.param_dtype, name="k_norm")(k)
    interleave = c.indexer_rope_interleave
    q = apply_rope(q, cos, sin, interleave)  # [B, T, H, D]
    k = apply_rope(k[:, :, None, :], cos, sin, interleave)[:, :, 0, :]  # [B, T, D]
    w = Dense((heads,), ("embed", "heads"), name="weights_proj", **dense)(x)
    w = w.astype(jnp.float32) * heads**-0.5 * dim**-0.5  # both scales fold into the head weights

    def scores(keys_: jax.Array) -> jax.Array:
      """[B, T, N] index scores of the block queries against keys_ [B, N, D]."""
      qk = jnp.einsum("bthd,bnd->bthn", q.astype(jnp.float32), keys_.astype(jnp.float32))
      return jnp.einsum("bth,bthn->btn", w, jax.nn.relu(qk))

    sees_block = block_visibility(block_mask, batch, t)
    if keys is None:
      block_scores = scores(k)
      self.sow("intermediates", "index_scores", block_scores)
      return Selection(None, select_topk(block_scores, sees_block, c.index_topk)), None

    keys, k = keys.write(layer, start, k)
    size = keys.max_len
    cached = scores(keys.read(layer, 0, size))  # [B, T, S]
    sees_cache = jnp.arange(size)[None, None, :] < start[:, None, None]  # committed slots
    both = jnp.concatenate([cached, scores(k)], axis=-1)
    self.sow("intermediates", "index_scores", both)
    sees = jnp.concatenate([jnp.broadcast_to(sees_cache, (batch, t, size)), sees_block], -1)
    kept = select_topk(both, sees, c.index_topk)
    return Selection(kept[..., :size], kept[..., size:]), keys
