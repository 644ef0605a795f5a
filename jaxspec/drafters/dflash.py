"""DFlash: a block-diffusion drafter that drafts a whole block in one non-causal forward pass.

Architecture (z-lab/dflash `DFlashDraftModel`; see docs/drafters.md):

- context features: the outputs of target layers `target_layer_ids` (HF hidden_states[id + 1])
  at committed positions, concatenated ([T, n_taps·H]) and fused by `fc` (no bias) then
  `hidden_norm` (RMSNorm) into one [T, H] context, shared by every drafter layer;
- the block `[bonus, MASK × (B−1)]` at positions start..start+B−1 (start = the bonus token's
  slot), embedded with the target's (frozen, shared) embedding;
- a stack of Qwen3-style layers (pre-RMSNorm, q/k/v projections with per-head q_norm/k_norm,
  absolute RoPE, SwiGLU MLP). Queries come from the block only; keys and values are
  [k_norm(k_proj(context)); k_norm(k_proj(LN(block)))] and [v_proj(context); v_proj(LN(block))]
  with the layer's own projections: the context enters each layer only as extra K/V, never
  through its input norm. Attention is non-causal over all of it;
- a final `norm`, then the target's LM head: block slots 1..B−1 give the B−1 drafts.

The drafter keeps the per-layer K/V of committed context positions across steps (post-k_norm,
post-RoPE, like a KV cache) and only appends the a+1 positions each verify commits. An optional
window limits what the block sees to the most recent features: per layer from the checkpoint's
`sliding_window` layer types (each query sees the positions less than its window behind it),
and with `context_window` = N (default 4096): every block sees only the N most recent context
features, and the store is a ring of N slots with the position each came from (memory O(N)
for long contexts, as Lucebox's long-context DFlash keeps its last 4096 target features).

At inference (`block_logits` / `propose`) the block reads the context store in chunks of
`DFlashDrafter.context_chunk` slots with an online softmax, only up to the live slots (the longest
context in the batch, capped at the store's size), so a propose costs what the sequence costs,
not what `max_len` costs (`chunked_block_attention`). Training keeps the dense, differentiable
`block_attention` over the whole sequence context.

`train_hidden` runs the same layers in training form: many blocks at random anchors in one
pass, each seeing the context strictly before its anchor and itself bidirectionally
(jaxspec.train.drafter_losses builds the loss on it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.options import RunOptions
from jaxspec.drafters.base import (
  CommitContext,
  Drafter,
  PrefillContext,
  Proposal,
  ProposeContext,
  check_gamma,
)
from jaxspec.io import drafter_ckpt
from jaxspec.io.hf import read_config
from jaxspec.models.attention import NEG_INF, OnlineSoftmax
from jaxspec.models.layers import (
  MLP,
  Dense,
  RMSNorm,
  apply_rope,
  dtype_of,
  rope_tables,
  unfused_logits,
)
from jaxspec.models.target import InputError, TargetModel
from jaxspec import sampling
from jaxspec.quant.formats import materialize
from jaxspec.state import KV_AXES


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
  """DFlash's default taps: `num_draft_layers` ids spread evenly over [1, L−3]."""
  if num_draft_layers == 1:
    return (num_target_layers // 2,)
  lo, hi = 1, num_target_layers - 3
  return tuple(
    int(round(lo + i * (hi - lo) / (num_draft_layers - 1))) for i in range(num_draft_layers)
  )


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Architecture of a DFlash drafter.

  vocab_size / target_hidden_size / num_target_layers describe the target it was built for
  (0 = unknown); `layer_windows[i]` is layer i's sliding window over the context (0 = full).
  """

  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  target_layer_ids: tuple[int, ...]
  mask_token_id: int
  block_size: int = 16
  vocab_size: int = 0
  target_hidden_size: int = 0
  num_target_layers: int = 0
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  attention_bias: bool = False
  layer_windows: tuple[int, ...] = ()
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    if not self.layer_windows:
      object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
    object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
    if not self.target_hidden_size:
      object.__setattr__(self, "target_hidden_size", self.hidden_size)

    def need(cond: bool, msg: str) -> None:
      if not cond:
        raise ConfigError(f"DFlash drafter: {msg}")

    for name in (
      "hidden_size",
      "num_layers",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
    ):
      need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
    need(
      self.num_heads % self.num_kv_heads == 0,
      f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
      f"({self.num_kv_heads})",
    )
    need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
    need(len(self.target_layer_ids) >= 1, "target_layer_ids must name at least one layer")
    need(
      all(i >= 0 for i in self.target_layer_ids),
      f"target_layer_ids must be non-negative, got {list(self.target_layer_ids)}",
    )
    need(self.block_size >= 2, f"block_size must be ≥ 2, got {self.block_size}")
    need(self.mask_token_id >= 0, f"mask_token_id must be set, got {self.mask_token_id}")
    need(
      len(self.layer_windows) == self.num_layers,
      f"layer_windows has {len(self.layer_windows)} entries for {self.num_layers} layers",
    )
    need(all(w >= 0 for w in self.layer_windows), "sliding windows must be ≥ 0 (0 = full)")
    if self.vocab_size:
      need(
        self.mask_token_id < self.vocab_size,
        f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})",
      )
    if self.num_target_layers:
      need(
        max(self.target_layer_ids) < self.num_target_layers,
        f"target_layer_ids {list(self.target_layer_ids)} reach past the target's "
        f"{self.num_target_layers} layers",
      )

  @property
  def num_taps(self) -> int:
    return len(self.target_layer_ids)

  def body(self) -> ModelConfig:
    """The Qwen3-shaped config the drafter layers are built from (for shared modules)."""
    return ModelConfig(
      architecture="Qwen3ForCausalLM",
      vocab_size=max(self.vocab_size, 1),
      hidden_size=self.hidden_size,
      num_layers=self.num_layers,
      num_heads=self.num_heads,
      num_kv_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      intermediate_size=self.intermediate_size,
      rms_norm_eps=self.rms_norm_eps,
      rope_theta=self.rope_theta,
      attention_bias=self.attention_bias,
      attention_out_bias=self.attention_bias,
      qk_norm=True,
      options=RunOptions(dtype=self.dtype, param_dtype=self.param_dtype),
    )

  def replace(self, **changes: Any) -> "DFlashConfig":
    return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# Shared target pieces (embedding and LM head)
# --------------------------------------------------------------------------------------------------


def shared_target_params(target: TargetModel) -> dict:
  """The target's embedding (and untied LM head) as drafter parameters; nothing is copied."""
  out = {"embed": target.params["embed"]}
  if not target.config.tie_word_embeddings:
    out["lm_head"] = target.params["lm_head"]["kernel"]
  return out


def embed_tokens(shared: dict, tokens: jax.Array, dtype: str) -> jax.Array:
  return jnp.take(shared["embed"], tokens, axis=0).astype(dtype_of(dtype))


def target_head(shared: dict, h: jax.Array, dtype: str) -> jax.Array:
  """The target's LM head on drafter hidden states: float32 logits [..., V]."""
  dt = dtype_of(dtype)
  if "lm_head" in shared:
    return unfused_logits(
      jnp.einsum(
        "...h,hv->...v",
        h.astype(dt),
        materialize(shared["lm_head"], dt),
        preferred_element_type=jnp.float32,
      )
    )
  return unfused_logits(
    jnp.einsum(
      "...h,vh->...v", h.astype(dt), shared["embed"].astype(dt), preferred_element_type=jnp.float32
    )
  )


def head_rows_expectation(shared: dict, probs: jax.Array) -> jax.Array:
  """Σ_v probs[..., v]·W[:, v] [..., H]: the head's output rows averaged under `probs`.

  Since `target_head` is linear, h·head_rows_expectation(p) = Σ_v p_v·logits_v(h) (the soft
  cross-entropy's cross term) at [..., H] cost instead of [..., V].
  """
  probs = probs.astype(jnp.float32)
  if "lm_head" in shared:
    return jnp.einsum("...v,hv->...h", probs, materialize(shared["lm_head"], jnp.float32))
  return jnp.einsum("...v,vh->...h", probs, shared["embed"].astype(jnp.float32))


def check_target(
  target: TargetModel,
  *,
  hidden_size: int,
  target_hidden_size: int,
  vocab_size: int,
  tap_ids: tuple[int, ...],
  what: str,
) -> None:
  """Clear errors for a drafter built for a different target."""
  tc = target.config
  if vocab_size and vocab_size != tc.vocab_size:
    raise InputError(
      f"{what} drafter vocabulary ({vocab_size}) differs from the target's ({tc.vocab_size})"
    )
  if target_hidden_size and target_hidden_size != tc.hidden_size:
    raise InputError(
      f"{what} drafter expects target features of size {target_hidden_size}, but "
      f"the target's hidden size is {tc.hidden_size}"
    )
  if hidden_size != tc.hidden_size:
    raise InputError(
      f"{what} drafter hidden size ({hidden_size}) differs from the target's "
      f"({tc.hidden_size}); it shares the target's embedding and LM head"
    )
  bad = [i for i in tap_ids if not 0 <= i < tc.num_layers]
  if bad:
    raise InputError(
      f"{what} drafter taps target layers {list(tap_ids)}, but the target has "
      f"{tc.num_layers} layers"
    )


# --------------------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------------------


def block_attention(
  q: jax.Array,
  ctx_k: jax.Array,
  ctx_v: jax.Array,
  ctx_visible: jax.Array,
  blk_k: jax.Array,
  blk_v: jax.Array,
  scale: float,
) -> jax.Array:
  """Non-causal attention of N blocks over [context; own block].

  q [B, N, T, H, D]; ctx_k/ctx_v [B, C, K, D] (shared by all blocks); ctx_visible [B, N, T, C];
  blk_k/blk_v [B, N, T, K, D] (each block sees all of itself, nothing of other blocks).
  Returns [B, N, T, H, D].
  """
  b, n, t, h, d = q.shape
  kv = ctx_k.shape[2]
  qg = q.reshape(b, n, t, kv, h // kv, d)
  s_ctx = (
    jnp.einsum("bntkgd,bckd->bnkgtc", qg, ctx_k.astype(q.dtype), preferred_element_type=jnp.float32)
    * scale
  )
  s_ctx = jnp.where(ctx_visible[:, :, None, None], s_ctx, NEG_INF)
  s_blk = jnp.einsum("bntkgd,bnukd->bnkgtu", qg, blk_k, preferred_element_type=jnp.float32) * scale
  c = s_ctx.shape[-1]
  probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
  out = jnp.einsum(
    "bnkgtc,bckd->bntkgd",
    probs[..., :c].astype(q.dtype),
    ctx_v.astype(q.dtype),
    preferred_element_type=jnp.float32,
  ) + jnp.einsum(
    "bnkgtu,bnukd->bntkgd",
    probs[..., c:].astype(q.dtype),
    blk_v,
    preferred_element_type=jnp.float32,
  )
  return out.reshape(b, n, t, h, d).astype(q.dtype)


class DFlashAttention(nn.Module):
  config: ModelConfig

  def setup(self):
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    self.q_proj = Dense(
      (c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), c.attention_bias, **dense
    )
    self.k_proj = Dense(
      (c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.attention_bias, **dense
    )
    self.v_proj = Dense(
      (c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), c.attention_bias, **dense
    )
    self.o_proj = Dense(
      (c.hidden_size,), ("heads", "head_dim", "embed"), c.attention_out_bias, in_dims=2, **dense
    )
    self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, "head_dim", c.param_dtype)
    self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, "head_dim", c.param_dtype)

  def keys_values(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
    """K (k_norm, RoPE) and V of inputs x [B, T, H] at the positions of cos/sin."""
    return apply_rope(self.k_norm(self.k_proj(x)), cos, sin), self.v_proj(x)

  def queries(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    return apply_rope(self.q_norm(self.q_proj(x)), cos, sin)

  def output(self, o: jax.Array) -> jax.Array:
    return self.o_proj(o)


class DFlashLayer(nn.Module):
  """One drafter layer: x + attn(LN(x) over [ctx; LN(x)]); x + mlp(LN(x))."""

  config: ModelConfig

  def setup(self):
    c = self.config
    self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)
    self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)
    self.self_attn = DFlashAttention(c)
    self.mlp = MLP(c, c.intermediate_size)

  def context_kv(self, ctx: jax.Array, cos: jax.Array, sin: jax.Array):
    """The layer's K/V of fused context features: the same k/v projections and k_norm as the
    block, and no input norm."""
    return self.self_attn.keys_values(ctx, cos, sin)

  def __call__(
    self,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    view: ContextView,
  ) -> jax.Array:
    """x [B, N, T, H] (N blocks of T tokens); cos/sin [B, N·T, rd]; ctx_k/ctx_v the context
    store ([L, B, C, K, D] with view.layer, or this layer's [B, C, K, D]), read as `view` says
    (context_attention)."""
    c = self.config
    b, n, t, hdim = x.shape
    xn = self.input_layernorm(x).reshape(b, n * t, hdim)
    q = self.self_attn.queries(xn, cos, sin)
    k, v = self.self_attn.keys_values(xn, cos, sin)
    split = lambda a: a.reshape(b, n, t, *a.shape[2:])
    o = context_attention(split(q), ctx_k, ctx_v, split(k), split(v), c.head_dim**-0.5, view)
    x = x + self.self_attn.output(o.reshape(b, n * t, *o.shape[3:])).reshape(x.shape)
    return x + self.mlp(self.post_attention_layernorm(x))


def context_visibility(
  q_pos: jax.Array, ctx_pos: jax.Array, limit: jax.Array, window: int, keep: int = 0
) -> jax.Array:
  """[B, N, T, C]: block query at q_pos [B, N, T] sees stored context position ctx_pos [B, C]
  iff 0 ≤ ctx_pos < limit [B, N] (strictly before its block), with a window W > 0
  q_pos − ctx_pos < W, and with keep K > 0 ctx_pos ≥ limit − K (the block's K most recent)."""
  cp = ctx_pos[:, None, None, :]
  lim = limit[:, :, None, None]
  vis = (cp >= 0) & (cp < lim)
  if window:
    vis = vis & (q_pos[..., None] - cp < window)
  if keep:
    vis = vis & (cp >= lim - keep)
  return vis


# Context slots read per step of the chunked (inference) context attention.
DEFAULT_CONTEXT_CHUNK = 256
# Target features a drafter keeps for long contexts (the ring's size; 0 = all).
DEFAULT_CONTEXT_WINDOW = 4096


@flax.struct.dataclass
class ContextView:
  """What a layer's block queries see of the context store, and how it is read.

  q_pos [B, N, T] block positions; ctx_pos [B, C] the position held by each store slot (−1 =
  empty); limit [B, N] block n sees positions < limit[:, n]; window (static, 0 = none) the
  layer's effective sliding window. chunk (static): 0 = dense `block_attention` over all C
  slots (differentiable; training); > 0 = `chunked_block_attention` in chunks of that many
  slots up to the live ones (inference). ring (static): the store is a ring (slot = position mod
  C, `context_window`) rather than slot = position; keep (static, 0 = all): a block sees only
  the `keep` most recent context positions before its limit. layer (static): with a stacked store
  [L, B, C, K, D], the layer to read (chunks are sliced straight out of the stack: slicing the
  layer first would copy all C slots); None for a single layer's store [B, C, K, D].
  """

  q_pos: jax.Array
  ctx_pos: jax.Array
  limit: jax.Array
  window: int = flax.struct.field(pytree_node=False, default=0)
  chunk: int = flax.struct.field(pytree_node=False, default=0)
  ring: bool = flax.struct.field(pytree_node=False, default=False)
  layer: Optional[int] = flax.struct.field(pytree_node=False, default=None)
  keep: int = flax.struct.field(pytree_node=False, default=0)


def chunked_block_attention(
  q: jax.Array,
  ctx_k: jax.Array,
  ctx_v: jax.Array,
  blk_k: jax.Array,
  blk_v: jax.Array,
  scale: float,
  view: ContextView,
) -> jax.Array:
  """`block_attention` with `context_visibility(view...)`, reading only the live store slots.

  q [B, N, T, H, D]; ctx_k/ctx_v [B, C, K, D] (or [L, B, C, K, D] with view.layer);
  blk_k/blk_v [B, N, T, K, D] → [B, N, T, H, D].
  The block's own (non-causal) part seeds an online softmax (attention.OnlineSoftmax); then a
  lax.fori_loop reads the store in chunks of `view.chunk` slots up to min(max(limit), C): with
  slot = position mod C every visible position (< limit) lives below that slot. Without a ring
  (slot = position) and with a sliding window W, chunks wholly before min(q_pos) − W + 1 are
  skipped too. The last chunk is clamped to end at C; slots it re-reads are masked, as in
  attention.attend_xla. Nothing past the live slots is read, so the cost follows the sequence,
  not C. Not reverse-differentiable (dynamic trip count); training uses block_attention.
  """
  b, n, t, h, d = q.shape
  cap, kv = ctx_k.shape[-3], ctx_k.shape[-2]
  qg = q.reshape(b, n, t, kv, h // kv, d)
  carry = OnlineSoftmax.init((b, n, kv, h // kv, t), d)

  s_blk = jnp.einsum("bntkgd,bnukd->bnkgtu", qg, blk_k, preferred_element_type=jnp.float32) * scale
  m_new, alpha, p = OnlineSoftmax.weights(carry, s_blk, jnp.ones((), bool))
  pv = jnp.einsum(
    "bnkgtu,bnukd->bnkgtd", p.astype(q.dtype), blk_v, preferred_element_type=jnp.float32
  )
  carry = OnlineSoftmax.add(carry, m_new, alpha, p, pv)

  size = min(view.chunk, cap)
  live = jnp.minimum(jnp.max(view.limit), cap)
  hi = (live + size - 1) // size
  lo = 0
  if view.window and not view.ring:
    lo = jnp.clip(jnp.min(view.q_pos) - view.window + 1, 0, cap) // size
    lo = jnp.minimum(lo, hi)

  def read(store: jax.Array, offset: jax.Array) -> jax.Array:  # → [B, S, K, D]
    if view.layer is None:
      return jax.lax.dynamic_slice_in_dim(store, offset, size, axis=1)
    start = (view.layer, 0, offset, 0, 0)
    return jax.lax.dynamic_slice(store, start, (1, b, size, kv, d))[0]

  def body(i, carry):
    first = i * size
    offset = jnp.minimum(first, cap - size)  # the last chunk ends at C; re-read slots are masked
    k, v = (read(a, offset).astype(q.dtype) for a in (ctx_k, ctx_v))
    pos = jax.lax.dynamic_slice_in_dim(view.ctx_pos, offset, size, axis=1)
    fresh = offset + jnp.arange(size) >= first
    vis = context_visibility(view.q_pos, pos, view.limit, view.window, view.keep) & fresh
    scores = jnp.einsum("bntkgd,bskd->bnkgts", qg, k, preferred_element_type=jnp.float32) * scale
    m_new, alpha, p = OnlineSoftmax.weights(carry, scores, vis[:, :, None, None])
    pv = jnp.einsum("bnkgts,bskd->bnkgtd", p.astype(q.dtype), v, preferred_element_type=jnp.float32)
    return OnlineSoftmax.add(carry, m_new, alpha, p, pv)

  carry = jax.lax.fori_loop(lo, hi, body, carry)
  out = OnlineSoftmax.finish(carry)  # [B, N, K, G, T, D]
  return jnp.moveaxis(out, 4, 2).reshape(b, n, t, h, d).astype(q.dtype)


def context_attention(
  q: jax.Array,
  ctx_k: jax.Array,
  ctx_v: jax.Array,
  blk_k: jax.Array,
  blk_v: jax.Array,
  scale: float,
  view: ContextView,
) -> jax.Array:
  """Block attention over [context store; own block]: chunked when view.chunk > 0 (inference),
  dense over every slot otherwise (training, differentiable). Same visibility either way."""
  if view.chunk:
    return chunked_block_attention(q, ctx_k, ctx_v, blk_k, blk_v, scale, view)
  if view.layer is not None:
    ctx_k, ctx_v = ctx_k[view.layer], ctx_v[view.layer]
  vis = context_visibility(view.q_pos, view.ctx_pos, view.limit, view.window, view.keep)
  return block_attention(q, ctx_k, ctx_v, vis, blk_k, blk_v, scale)


class DFlashModel(nn.Module):
  """Parameters: fc, hidden_norm, layers_{i}, norm (the published layout's names)."""

  config: DFlashConfig

  def setup(self):
    c = self.config
    body = c.body()
    self.fc = Dense((c.hidden_size,), ("mlp", "embed"), dtype=c.dtype, param_dtype=c.param_dtype)
    self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)
    self.layers = [DFlashLayer(body, name=f"layers_{i}") for i in range(c.num_layers)]
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)

  def _rope(self, positions: jax.Array):
    return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

  def context_kv(self, feats: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """feats [B, T, n_taps·H_t] at positions [B, T] → per-layer K, V [L, B, T, K, D]."""
    ctx = self.hidden_norm(self.fc(feats.astype(dtype_of(self.config.dtype))))
    cos, sin = self._rope(positions)
    kvs = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
    return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

  def __call__(
    self,
    x: jax.Array,
    q_pos: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_pos: jax.Array,
    limit: jax.Array,
    window_cap: int = 0,
    context_chunk: int = 0,
  ) -> jax.Array:
    """N blocks x [B, N, T, H] at positions q_pos [B, N, T] → final-normed hidden [B, N, T, H].

    ctx_k/ctx_v [L, B, C, K, D] hold context K/V at positions ctx_pos [B, C] (−1 = empty);
    block n sees context positions < limit[:, n] (within each layer's window). window_cap > 0
    keeps only the window_cap most recent of them for every block and means the store is a ring
    (slot = position mod C).

    context_chunk (static): 0 reads all C slots densely (training: differentiable);
    > 0 reads the store in chunks of that many slots up to the live ones (inference: needs
    slot = position mod C, as DFlashDrafter's store keeps them; not reverse-differentiable).
    """
    b, n, t, _ = x.shape
    cos, sin = self._rope(q_pos.reshape(b, n * t))
    for i, layer in enumerate(self.layers):
      window = self.config.layer_windows[i]
      ring = bool(window_cap)
      view = ContextView(q_pos, ctx_pos, limit, window, context_chunk, ring, i, window_cap)
      x = layer(x, cos, sin, ctx_k, ctx_v, view)
    return self.norm(x)

  def init_all(self, feats: jax.Array, x: jax.Array):
    b = x.shape[0]
    pos = jnp.zeros((b, 1), jnp.int32)
    k, v = self.context_kv(feats, pos)
    return self(x, pos[:, None], k, v, pos, jnp.ones((b, 1), jnp.int32))


def param_shapes(config: DFlashConfig) -> Any:
  """The parameter tree's shapes (jax.ShapeDtypeStruct), without running anything."""
  feats = jnp.zeros((1, 1, config.num_taps * config.target_hidden_size), jnp.float32)
  x = jnp.zeros((1, 1, 1, config.hidden_size), jnp.float32)
  abstract = jax.eval_shape(
    lambda: DFlashModel(config).init(jax.random.PRNGKey(0), feats, x, method=DFlashModel.init_all)
  )
  return nn.meta.unbox(abstract["params"])


def logical_axes(config: DFlashConfig) -> Any:
  feats = jnp.zeros((1, 1, config.num_taps * config.target_hidden_size), jnp.float32)
  x = jnp.zeros((1, 1, 1, config.hidden_size), jnp.float32)
  abstract = jax.eval_shape(
    lambda: DFlashModel(config).init(jax.random.PRNGKey(0), feats, x, method=DFlashModel.init_all)
  )
  return nn.get_partition_spec(abstract)["params"]


def init_params(config: DFlashConfig, seed: int = 0, stddev: float = 0.02) -> Any:
  """Random parameters: normal(stddev) matrices, zero biases, unit norm scales."""
  rng = np.random.default_rng(seed)

  def make(path, leaf):
    name = jax.tree_util.keystr(path)
    if "scale" in name:
      return jnp.ones(leaf.shape, leaf.dtype)
    if "bias" in name:
      return jnp.zeros(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, stddev, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(make, param_shapes(config))


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class DFlashState:
  ctx_k: jax.Array  # [L, B, C, K, D] context keys (post k_norm and RoPE), per drafter layer
  ctx_v: jax.Array  # [L, B, C, K, D]
  ctx_pos: jax.Array  # [B, C] int32: position held by each slot, −1 = empty

  AXES: ClassVar[dict] = {"ctx_k": KV_AXES, "ctx_v": KV_AXES, "ctx_pos": ("batch", "length")}


def _concat_taps(taps: jax.Array) -> jax.Array:
  """[n_taps, B, T, H] → [B, T, n_taps·H] (tap 0's features first, as torch.cat(dim=-1))."""
  n, b, t, h = taps.shape
  return jnp.moveaxis(taps, 0, 2).reshape(b, t, n * h)


@dataclasses.dataclass(frozen=True)
class DFlashDrafter(Drafter):
  """DFlash behind the Drafter protocol.

  gamma: drafts per step = block length − 1 (None: the trained block_size − 1). A shorter
    block may be used at inference; a longer one was never trained and is refused.
  sample_drafts: at T > 0 draw each block position from its warped marginal q (returned for
    lossless chain verification; the default: measured to accept about twice as often per
    position at T = 1 as the argmax, docs/drafters.md); False (the reference's behaviour)
    drafts the argmax at every temperature, a one-hot q. Greedy rows draft the argmax either
    way. `logprobs` holds the per-position log-probabilities log_softmax(logits / T) (T = 1
    for greedy rows) for tree verification.
  context_window: if > 0, every block sees only this many most recent context features, and
    the feature K/V store is a ring of that many slots (default 4096); 0 keeps every one.
  context_chunk: store slots read per step of the inference context attention (default
    DEFAULT_CONTEXT_CHUNK = 256): a propose reads ceil(live / chunk) chunks, live = the longest
    context in the batch (at most the store's size), whatever max_len is. 0 = read every slot
    densely (the training path's block_attention).
  params: {"draft": DFlashModel parameters, "embed": target embedding, "lm_head": target LM
    head kernel (absent for tied embeddings)}.
  """

  config: DFlashConfig = None  # type: ignore[assignment]
  gamma: Optional[int] = None  # type: ignore[assignment]
  sample_drafts: bool = True
  context_window: int = DEFAULT_CONTEXT_WINDOW
  context_chunk: int = DEFAULT_CONTEXT_CHUNK
  hf_config: Optional[dict] = dataclasses.field(default=None, compare=False, hash=False, repr=False)

  def __post_init__(self):
    if self.config is None:
      raise ConfigError("DFlashDrafter needs a DFlashConfig")
    if self.gamma is None:
      object.__setattr__(self, "gamma", self.config.block_size - 1)
    check_gamma(
      "DFlashDrafter",
      self.gamma,
      self.config.block_size - 1,
      f" (the drafter was trained on blocks of {self.config.block_size} = γ + 1 tokens)",
    )
    if self.context_window and self.context_window < self.gamma + 1:
      raise ConfigError(
        f"context_window ({self.context_window}) must hold at least one block "
        f"({self.gamma + 1} positions)"
      )
    if self.context_chunk < 0:
      raise ConfigError(f"context_chunk must be ≥ 0 (0 = dense), got {self.context_chunk}")

  # -- construction ------------------------------------------------------------------------------

  @classmethod
  def for_target(
    cls, target: TargetModel, config: DFlashConfig, draft_params: Any, **kwargs: Any
  ) -> "DFlashDrafter":
    """Binds drafter weights to a target (shared embedding and LM head), checking sizes."""
    check_target(
      target,
      hidden_size=config.hidden_size,
      target_hidden_size=config.target_hidden_size,
      vocab_size=config.vocab_size,
      tap_ids=config.target_layer_ids,
      what="DFlash",
    )
    if not 0 <= config.mask_token_id < target.config.vocab_size:
      raise InputError(
        f"DFlash mask_token_id {config.mask_token_id} is outside the target "
        f"vocabulary ({target.config.vocab_size})"
      )
    config = config.replace(
      vocab_size=target.config.vocab_size,
      num_target_layers=target.config.num_layers,
      dtype=target.config.dtype,
    )
    params = {"draft": draft_params, **shared_target_params(target)}
    return cls(params=params, config=config, **kwargs)

  @classmethod
  def random(
    cls,
    target: TargetModel,
    *,
    mask_token_id: Optional[int] = None,
    num_layers: int = 1,
    block_size: int = 16,
    target_layer_ids: Optional[tuple[int, ...]] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    layer_windows: tuple[int, ...] = (),
    seed: int = 0,
    stddev: float = 0.02,
    **kwargs: Any,
  ) -> "DFlashDrafter":
    """A freshly initialised drafter for `target` (sizes default to the target's; the mask id to
    the target tokenizer's mask token)."""
    tc = target.config
    if mask_token_id is None:
      mask_token_id = getattr(target.tokenizer, "mask_id", None)
      if mask_token_id is None:
        raise ConfigError(
          "DFlash needs a mask token: pass mask_token_id (the target has no tokenizer with one)"
        )
    ids = target_layer_ids or build_target_layer_ids(tc.num_layers, num_layers)
    config = DFlashConfig(
      hidden_size=tc.hidden_size,
      num_layers=num_layers,
      num_heads=num_heads or tc.num_heads,
      num_kv_heads=num_kv_heads or tc.num_kv_heads,
      head_dim=head_dim or tc.head_dim,
      intermediate_size=intermediate_size or tc.intermediate_size,
      target_layer_ids=ids,
      mask_token_id=mask_token_id,
      block_size=block_size,
      vocab_size=tc.vocab_size,
      target_hidden_size=tc.hidden_size,
      num_target_layers=tc.num_layers,
      rms_norm_eps=tc.rms_norm_eps,
      rope_theta=tc.rope_theta,
      layer_windows=layer_windows,
      dtype=tc.dtype,
    )
    return cls.for_target(target, config, init_params(config, seed, stddev), **kwargs)

  # -- protocol ------------------------------------------------------------------------------------

  @property
  def taps(self) -> tuple[int, ...]:
    return self.config.target_layer_ids

  @property
  def vocab_size(self) -> Optional[int]:
    return self.config.vocab_size or None

  def param_axes(self) -> dict:
    axes = {"draft": logical_axes(self.config), "embed": PartitionSpec("vocab", "embed")}
    if "lm_head" in self.params:
      axes["lm_head"] = PartitionSpec("embed", "vocab")
    return axes

  @property
  def block_len(self) -> int:
    return self.gamma + 1

  def capacity(self, max_len: int) -> int:
    return min(self.context_window, max_len) if self.context_window else max_len

  def init_state(self, params: Any, batch: int, max_len: int) -> DFlashState:
    del params
    c = self.config
    cap = self.capacity(max_len)
    shape = (c.num_layers, batch, cap, c.num_kv_heads, c.head_dim)
    dt = dtype_of(c.dtype)
    return DFlashState(
      jnp.zeros(shape, dt), jnp.zeros(shape, dt), jnp.full((batch, cap), -1, jnp.int32)
    )

  def _write_context(
    self, params: Any, state: DFlashState, taps: jax.Array, positions: jax.Array, valid: jax.Array
  ) -> DFlashState:
    """Appends the K/V of target features taps [n_taps, B, T, H] at positions [B, T]."""
    k, v = DFlashModel(self.config).apply(
      {"params": params["draft"]}, _concat_taps(taps), positions, method=DFlashModel.context_kv
    )
    cap = state.ctx_pos.shape[1]
    rows = jnp.arange(positions.shape[0])[:, None]
    slots = jnp.where(valid, positions % cap, cap)
    ctx_k = state.ctx_k.at[:, rows, slots].set(k.astype(state.ctx_k.dtype), mode="drop")
    ctx_v = state.ctx_v.at[:, rows, slots].set(v.astype(state.ctx_v.dtype), mode="drop")
    ctx_pos = state.ctx_pos.at[rows, slots].set(positions, mode="drop")
    return DFlashState(ctx_k, ctx_v, ctx_pos)

  def prefill(self, params: Any, state: DFlashState, ctx: PrefillContext) -> DFlashState:
    pos = ctx.positions()
    lens = ctx.prompt_lens[:, None]
    valid = (pos < lens) & (pos >= lens - state.ctx_pos.shape[1])
    return self._write_context(params, state, ctx.taps, pos, valid)

  def block_logits(
    self, params: Any, state: DFlashState, block: jax.Array, start: jax.Array
  ) -> jax.Array:
    """Drafter logits [B, T, V] of a block [B, T] at positions start..start+T−1, attending to
    the stored context before `start` (read in chunks of `context_chunk` live slots)."""
    c = self.config
    t = block.shape[1]
    x = embed_tokens(params, block, c.dtype)[:, None]
    q_pos = (start[:, None] + jnp.arange(t, dtype=jnp.int32)[None])[:, None]
    h = DFlashModel(c).apply(
      {"params": params["draft"]},
      x,
      q_pos,
      state.ctx_k,
      state.ctx_v,
      state.ctx_pos,
      start[:, None],
      self.context_window,
      self.context_chunk,
    )
    return target_head(params, h[:, 0], c.dtype)

  def propose(
    self, params: Any, state: DFlashState, ctx: ProposeContext
  ) -> tuple[Proposal, DFlashState]:
    b = ctx.tokens.shape[0]
    rows = jnp.arange(b)
    start = ctx.seq_len - 1  # the bonus token's slot: context exists for positions < start
    root = ctx.tokens[rows, start]
    block = jnp.concatenate(
      [root[:, None], jnp.full((b, self.gamma), self.config.mask_token_id, jnp.int32)], axis=1
    )
    logits = self.block_logits(params, state, block, start)[:, 1:]  # [B, γ, V]
    temp = jnp.where(sampling.is_greedy(ctx.sampling), 1.0, ctx.sampling.temperature)
    logprobs = jax.nn.log_softmax(logits / temp[:, None, None].astype(jnp.float32), axis=-1)
    if self.sample_drafts:

      def sampled():
        q = sampling.warped_probs(logits, ctx.sampling)
        return sampling.sample_from_probs(ctx.key, q), q

      def greedy():  # the same drafts and q, without the vocabulary-wide draw
        ids = sampling.argmax(logits)
        return ids, jax.nn.one_hot(ids, logits.shape[-1], dtype=jnp.float32)

      drafts, q = jax.lax.cond(jnp.all(sampling.is_greedy(ctx.sampling)), greedy, sampled)
      return Proposal(drafts, q, logprobs), state
    return Proposal(sampling.argmax(logits), None, logprobs), state

  def commit(self, params: Any, state: DFlashState, ctx: CommitContext) -> DFlashState:
    start = ctx.old_seq_len - 1
    j = jnp.arange(ctx.hidden.shape[1], dtype=jnp.int32)[None]
    positions = start[:, None] + j
    # Features exist for every committed position before the new bonus token.
    valid = j < (ctx.seq_len - ctx.old_seq_len)[:, None]
    return self._write_context(params, state, ctx.taps, positions, valid)

  # -- training form -------------------------------------------------------------------------------

  def train_hidden(
    self,
    params: Any,
    tokens: jax.Array,
    taps: jax.Array,
    anchors: jax.Array,
    block_size: Optional[int] = None,
  ) -> jax.Array:
    """Training forward: final-normed hidden [B, N, bs, H] of N blocks in one pass.

    tokens [B, S]; taps [n_taps, B, S, H] target features of every position; anchors [B, N]:
    block n is [tokens[anchor], MASK × (bs−1)] at positions anchor..anchor+bs−1 and sees the
    context strictly before its anchor and all of itself; blocks never see each other.
    """
    c = self.config
    bs = block_size or c.block_size
    b, s = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32)[None], (b, s))
    model = DFlashModel(c)
    k, v = model.apply(
      {"params": params["draft"]}, _concat_taps(taps), pos, method=DFlashModel.context_kv
    )
    first = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, s - 1), axis=1)
    n = anchors.shape[1]
    block = jnp.concatenate(
      [first[..., None], jnp.full((b, n, bs - 1), c.mask_token_id, jnp.int32)], axis=-1
    )
    x = embed_tokens(params, block, c.dtype)
    q_pos = anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)
    return model.apply(
      {"params": params["draft"]}, x, q_pos, k, v, pos, anchors, self.context_window
    )


# --------------------------------------------------------------------------------------------------
# Published checkpoints (layout in jaxspec.io.drafter_ckpt)
# --------------------------------------------------------------------------------------------------


def config_from_hf(hf: dict, source: str = "config.json") -> DFlashConfig:
  """DFlashConfig of a DFlash `config.json` dict (`source` names it in errors)."""
  fields = drafter_ckpt.dflash_config_from_hf(hf, source=source)
  if fields["target_layer_ids"] is None:
    fields["target_layer_ids"] = build_target_layer_ids(
      fields["num_target_layers"], fields["num_layers"]
    )
  return DFlashConfig(**fields)


def load_dflash(model_dir: str, target: TargetModel, **kwargs: Any) -> DFlashDrafter:
  """A published DFlash checkpoint (z-lab layout) bound to `target`; sizes, vocabulary and
  tapped layers are checked. `kwargs` go to DFlashDrafter (gamma, sample_drafts, ...)."""
  hf = read_config(model_dir)
  config = config_from_hf(hf, source=os.path.join(model_dir, "config.json"))
  params, _, dtype = drafter_ckpt.read_checkpoint(
    model_dir, list(drafter_ckpt.dflash_tensor_map(config)), param_shapes(config)
  )
  config = config.replace(param_dtype=dtype)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  return DFlashDrafter.for_target(target, config, params, hf_config=hf, **kwargs)


def dflash_tensors(drafter: DFlashDrafter) -> dict[str, np.ndarray]:
  """The drafter's weights under their published names."""
  return drafter_ckpt.export_tensors(
    drafter_ckpt.dflash_tensor_map(drafter.config), drafter.params["draft"]
  )


def save_dflash(drafter: DFlashDrafter, out_dir: str) -> None:
  """Writes config.json and model.safetensors in the published DFlash layout."""
  drafter_ckpt.write_checkpoint(
    out_dir,
    drafter_ckpt.dflash_config_to_hf(drafter.config, drafter.hf_config),
    dflash_tensors(drafter),
  )
