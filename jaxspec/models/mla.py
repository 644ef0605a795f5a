"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2, GLM-5): attention over a latent cache.

Per token, MLA projects the hidden state to a KV latent c (kv_lora_rank values, RMS-normed) and
one RoPE key k_r (qk_rope_head_dim values) shared by all heads; `kv_b_proj` [r, H, dn + dv]
expands c to each head's non-positional key (W_UK, the first dn columns) and value (W_UV, the
last dv). Queries come from a plain q_proj or a low-rank pair (q_a_proj → RMSNorm → q_b_proj),
each head split into a non-positional part q_n (dn) and a RoPE part q_r (dr).

Two forms compute the same attention:

* expanded (no decoding state: training, full-sequence logits): K = [c·W_UK; k_r] and V = c·W_UV
  per head, ordinary multi-head attention with head dims dn + dr and dv.
* absorbed (with a state: prefill, decode, verify): W_UK is folded into the query,
  q' = [q_n·W_UKᵀ; q_r] [H, r + dr], which scores the cached vector [c; k_r] directly, one KV head
  shared by all heads; the softmax-weighted latent is then multiplied by W_UV. A step reads each
  cached token's r + dr values once for all heads (state/latent.py), instead of H · (dn + dr + dv).
  FLOPs per cached token and head grow from dn + dr + dv to 2r + dr, which decode, being bound by
  memory, does not notice; a long prefill would rather expand (not done here: prefill uses the
  absorbed form too).

RoPE: DeepSeek stores the RoPE features pairwise interleaved (`rope_interleave`); they are
de-interleaved before the rotate-half rotation (`layers.apply_rope`), as transformers does, and
cached so. The softmax scale is `config.attention_scale` ((dn + dr)^-0.5 with DeepSeek's YaRN
mscale²).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.models import attention as attention_lib
from jaxspec.models.dsa import Indexer
from jaxspec.models.layers import Dense, RMSNorm, apply_rope, dtype_of, normal_init, weight
from jaxspec.quant.formats import materialize


class KVUp(nn.Module):
  """`kv_b_proj`'s weight [kv_lora_rank, heads, dn + dv] (W_UK ‖ W_UV per head), materialized
  in the compute dtype (it may be stored quantized)."""

  config: ModelConfig

  @nn.compact
  def __call__(self) -> jax.Array:
    c = self.config
    kernel = weight(
      self,
      "kernel",
      nn.with_logical_partitioning(normal_init(), ("kv_lora", "heads", "head_dim")),
      (c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim),
      dtype_of(c.param_dtype),
    )
    return materialize(kernel, dtype_of(c.dtype))


class MLAttention(nn.Module):
  """MLA self-attention of a block over [committed prefix in the latent cache; the block].

  (x, kv, layer, start, cos, sin, block_mask, select) → (out, kv, select), `kv` a latent entry
  (state/latent.py) or None; cos/sin are tables of qk_rope_head_dim. In DSA targets each query
  attends only to the keys its lightning indexer chose (models/dsa.py): a layer with `indexer`
  runs its own (kv is then a `SparseLatent`, the latent cache beside the indexer's keys) and
  returns its choice; a "shared" layer uses the `select` it is given, the previous one's.
  """

  config: ModelConfig
  indexer: bool = False

  def query(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
    """x → (q [B, T, H, dn + dr], the q latent after q_a_layernorm or None)."""
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    heads = (c.num_heads, c.head_dim)
    if not c.q_lora_rank:
      q = Dense(heads, ("embed", "heads", "head_dim"), name="q_proj", **dense)(x)
      return q, None
    q_lat = Dense(
      (c.q_lora_rank,), ("embed", "q_lora"), c.attention_bias, name="q_a_proj", **dense
    )(x)
    q_lat = RMSNorm(c.q_lora_rank, c.rms_norm_eps, "q_lora", c.param_dtype, name="q_a_layernorm")(
      q_lat
    )
    q = Dense(heads, ("q_lora", "heads", "head_dim"), name="q_b_proj", **dense)(q_lat)
    return q, q_lat

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    kv: Any,
    layer: jax.Array,
    start: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    block_mask: jax.Array | None,
    select: attention_lib.Selection | None = None,
  ) -> tuple[jax.Array, Any, attention_lib.Selection | None]:
    c = self.config
    dn, dr, r = c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    q, q_lat = self.query(x)
    entry = kv
    if self.indexer:  # DSA: this layer's own top-k choice, from its own key cache
      keys = None if kv is None else kv.index
      select, keys = Indexer(c, name="indexer")(x, q_lat, cos, sin, keys, layer, start, block_mask)
      kv = None if kv is None else kv.latent
    q_nope, q_rope = q[..., :dn], apply_rope(q[..., dn:], cos, sin, c.rope_interleave)
    latent = Dense(
      (r + dr,), ("embed", "kv_lora"), c.attention_bias, name="kv_a_proj_with_mqa", **dense
    )(x)
    c_kv = RMSNorm(r, c.rms_norm_eps, "kv_lora", c.param_dtype, name="kv_a_layernorm")(
      latent[..., :r]
    )
    k_rope = apply_rope(latent[..., None, r:], cos, sin, c.rope_interleave)  # [B, T, 1, dr]
    up = KVUp(c, name="kv_b_proj")()
    w_uk, w_uv = up[..., :dn], up[..., dn:]
    impl, chunk = c.options.attention_impl, c.options.attention_chunk
    if kv is None:  # expanded: per-head K and V
      k_nope = jnp.einsum("btr,rhd->bthd", c_kv, w_uk)
      k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_nope.shape[:3], dr))], -1)
      v = jnp.einsum("btr,rhd->bthd", c_kv, w_uv)
      q = jnp.concatenate([q_nope, q_rope], axis=-1)
      q = sharding.constrain_activation(q, "heads", "head_dim")
      out, _ = attention_lib.attention(
        q, k, v, None, layer, start, block_mask, c.attention_scale, impl, chunk, select=select
      )
    else:  # absorbed: queries score the cached [c; k_r], one KV head for all heads
      q_abs = jnp.concatenate([jnp.einsum("bthd,rhd->bthr", q_nope, w_uk), q_rope], axis=-1)
      q_abs = sharding.constrain_activation(q_abs, "heads", "kv_lora")
      k_block = jnp.concatenate([c_kv[:, :, None], k_rope.astype(c_kv.dtype)], axis=-1)
      out_lat, kv = attention_lib.attention(
        q_abs, k_block, None, kv, layer, start, block_mask, c.attention_scale, impl, chunk,
        select=select,
      )
      out = jnp.einsum("bthr,rhd->bthd", out_lat, w_uv)
    if self.indexer and entry is not None:
      kv = entry.replace(latent=kv, index=keys)
    out = sharding.constrain_activation(out, "heads", "head_dim")
    out = Dense(
      (c.hidden_size,),
      ("heads", "head_dim", "embed"),
      c.attention_bias,
      name="o_proj",
      in_dims=2,
      **dense,
    )(out)
    return sharding.constrain_activation(out, "embed"), kv, select
