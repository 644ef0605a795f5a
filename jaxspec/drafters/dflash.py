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

The store is a decoding-state kind, `jaxspec.state.ContextRing` (K/V per drafter layer, the
position of each slot recorded). At inference (`block_logits` / `propose`) the block reads it
with the target's own chunked online-softmax reader (`models.attention.attend_xla`, chunks of
`DFlashDrafter.context_chunk` slots), only up to the live slots (the longest context in the
batch, capped at the store's size), so a propose costs what the sequence costs, not what
`max_len` costs. Training keeps the dense, differentiable `block_attention` over the whole
sequence context.

The target's embedding, LM head and tap concatenation are `jaxspec.drafters.features` (shared
with EAGLE-3); checkpoints are read and written by `jaxspec.io.drafter_ckpt`.

`train_hidden` runs the same layers in training form: many blocks at random anchors in one
pass, each seeing the context strictly before its anchor and itself bidirectionally
(jaxspec.train.drafter_losses builds the loss on it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.drafters import features
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.drafters.base import check_gamma
from jaxspec.drafters.feature_chain import tree_logprobs
from jaxspec.drafters.features import (
  DEFAULT_CONTEXT_WINDOW,
  check_target,
  concat_taps,
  embed_tokens,
  shared_target_params,
)
from jaxspec.io import drafter_ckpt
from jaxspec.io.drafter_ckpt import build_target_layer_ids  # noqa: F401 (DFlash's default taps)
from jaxspec.models import attention as attention_lib
from jaxspec.models.attention import NEG_INF
from jaxspec.models.layers import (
  MLP,
  Dense,
  RMSNorm,
  apply_rope,
  dtype_of,
  rope_tables,
)
from jaxspec.models.target import InputError, TargetModel
from jaxspec import sampling
from jaxspec.state import ContextRing


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
  """Architecture of a DFlash drafter.

  vocab_size / target_hidden_size / num_target_layers describe the target it was built for
  (0 = unknown); `layer_windows[i]` is layer i's sliding window over the context (0 = full);
  draft_vocab_size < vocab_size: drafts come from that many of the target's ids only (the
  drafter's `draft_vocab`), scored by their rows of the target's head (0 = all of them).
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
  draft_vocab_size: int = 0
  target_hidden_size: int = 0
  num_target_layers: int = 0
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1e6
  # RoPE scaling as ModelConfig.rope_scaling (() = none; YaRN in Kimi's DFlash drafters).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  attention_bias: bool = False
  layer_windows: tuple[int, ...] = ()
  dtype: str = "float32"
  param_dtype: str = "float32"
  # The target's embedding scale (ModelConfig.embedding_scale: Gemma's sqrt(hidden)), set
  # from the target with dtype; not part of the checkpoint.
  embed_scale: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    if not self.layer_windows:
      object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
    object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
    if not self.target_hidden_size:
      object.__setattr__(self, "target_hidden_size", self.hidden_size)
    sizes = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    need = features.check_layer_sizes(self, "DFlash", sizes + ("intermediate_size",))
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
    need(self.draft_vocab_size >= 0, f"draft_vocab_size must be ≥ 0, got {self.draft_vocab_size}")
    if self.vocab_size:
      need(
        self.mask_token_id < self.vocab_size,
        f"mask_token_id {self.mask_token_id} outside the vocabulary ({self.vocab_size})",
      )
      need(
        self.draft_vocab_size <= self.vocab_size,
        f"draft_vocab_size ({self.draft_vocab_size}) exceeds the vocabulary ({self.vocab_size})",
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

  @property
  def reduced_vocab(self) -> bool:
    return 0 < self.draft_vocab_size < self.vocab_size

  def body(self) -> ModelConfig:
    """The Qwen3-shaped config the drafter layers are built from (for shared modules)."""
    return features.layer_config(
      self,
      vocab_size=max(self.vocab_size, 1),
      num_layers=self.num_layers,
      attention_bias=self.attention_bias,
      attention_out_bias=self.attention_bias,
      qk_norm=True,
    )

  def replace(self, **changes: Any) -> "DFlashConfig":
    return dataclasses.replace(self, **changes)


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


@flax.struct.dataclass
class ContextView:
  """What a layer's block queries see of the context store, and how it is read.

  q_pos [B, N, T] block positions; ctx_pos [B, C] the position held by each store slot (−1 =
  empty); limit [B, N] block n sees positions < limit[:, n]; window (static, 0 = none) the
  layer's effective sliding window. chunk (static): 0 = dense `block_attention` over all C
  slots (differentiable; training); > 0 = the shared chunked reader (attention.attend_xla over
  the store as a `ContextRing`) in chunks of that many slots up to the live ones (inference,
  one block per row). keep (static, 0 = all): a block sees only the `keep` most recent context
  positions before its limit. layer (static): with a stacked store [L, B, C, K, D], the layer
  to read (chunks are sliced straight out of the stack: slicing the layer first would copy all
  C slots); None for a single layer's store [B, C, K, D].
  """

  q_pos: jax.Array
  ctx_pos: jax.Array
  limit: jax.Array
  window: int = flax.struct.field(pytree_node=False, default=0)
  chunk: int = flax.struct.field(pytree_node=False, default=0)
  layer: Optional[int] = flax.struct.field(pytree_node=False, default=None)
  keep: int = flax.struct.field(pytree_node=False, default=0)


def context_attention(
  q: jax.Array,
  ctx_k: jax.Array,
  ctx_v: jax.Array,
  blk_k: jax.Array,
  blk_v: jax.Array,
  scale: float,
  view: ContextView,
) -> jax.Array:
  """Block attention over [context store; own block]: chunked when view.chunk > 0 (inference:
  the store read as a `ContextRing` by the shared reader), dense over every slot otherwise
  (training, differentiable). Same visibility either way.

  q [B, N, T, H, D]; ctx_k/ctx_v [L, B, C, K, D] with view.layer (or [B, C, K, D]);
  blk_k/blk_v [B, N, T, K, D] → [B, N, T, H, D].
  """
  layer = view.layer
  if layer is None:
    ctx_k, ctx_v, layer = ctx_k[None], ctx_v[None], 0
  if not view.chunk:
    vis = context_visibility(view.q_pos, view.ctx_pos, view.limit, view.window, view.keep)
    return block_attention(q, ctx_k[layer], ctx_v[layer], vis, blk_k, blk_v, scale)
  b, n, t = q.shape[:3]
  if n != 1:
    raise ConfigError(
      f"the chunked context reader reads one block per row, got {n}; read N blocks densely "
      "(context_chunk=0, as training does)"
    )
  store = ContextRing(ctx_k, ctx_v, view.ctx_pos, view.keep)
  window = None  # the layer's window bounds the context only: a block sees all of itself
  if view.window:
    window = attention_lib.Window(view.window, view.q_pos[:, 0], in_block=False)
  out = attention_lib.attend_xla(
    q[:, 0],
    blk_k[:, 0],
    blk_v[:, 0],
    store,
    layer,
    view.limit[:, 0],
    jnp.ones((t, t), bool),  # non-causal inside the block
    scale,
    view.chunk,
    window,
  )
  return out.reshape(b, 1, *out.shape[1:])


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
    c = self.config
    return rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)

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
    keeps only the window_cap most recent of them for every block.

    context_chunk (static): 0 reads all C slots densely (training: differentiable);
    > 0 reads the store in chunks of that many slots up to the live ones (inference: needs
    slot = position mod C, as DFlashDrafter's store keeps them; not reverse-differentiable).
    """
    b, n, t, _ = x.shape
    cos, sin = self._rope(q_pos.reshape(b, n * t))
    for i, layer in enumerate(self.layers):
      window = self.config.layer_windows[i]
      view = ContextView(q_pos, ctx_pos, limit, window, context_chunk, i, window_cap)
      x = layer(x, cos, sin, ctx_k, ctx_v, view)
    return self.norm(x)

  def init_all(self, feats: jax.Array, x: jax.Array):
    b = x.shape[0]
    pos = jnp.zeros((b, 1), jnp.int32)
    k, v = self.context_kv(feats, pos)
    return self(x, pos[:, None], k, v, pos, jnp.ones((b, 1), jnp.int32))


def _abstract(config: DFlashConfig) -> Any:
  """The boxed parameter tree of `config`, evaluated for shapes only (nothing runs)."""
  feats = jnp.zeros((1, 1, config.num_taps * config.target_hidden_size), jnp.float32)
  x = jnp.zeros((1, 1, 1, config.hidden_size), jnp.float32)
  return features.abstract_params(DFlashModel(config), DFlashModel.init_all, feats, x)


def param_shapes(config: DFlashConfig) -> Any:
  """The parameter tree's shapes (jax.ShapeDtypeStruct), without running anything."""
  return nn.meta.unbox(_abstract(config)["params"])


def logical_axes(config: DFlashConfig) -> Any:
  return nn.get_partition_spec(_abstract(config))["params"]


def init_params(config: DFlashConfig, seed: int = 0, stddev: float = 0.02) -> Any:
  """Random parameters: normal(stddev) matrices, zero biases, unit norm scales."""
  return features.random_params(param_shapes(config), seed, stddev)


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


# The context store: K/V of the fused target features per drafter layer, in a ring of
# min(context_window, max_len) slots with the position of each (a decoding-state kind).
DFlashState = ContextRing


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
    head kernel (absent for tied embeddings); with a draft vocabulary also "draft_vocab" (its
    target ids) and "draft_head" (their head rows, `features.draft_head_params`)}.
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
    cls,
    target: TargetModel,
    config: DFlashConfig,
    draft_params: Any,
    draft_vocab: Optional[Any] = None,
    **kwargs: Any,
  ) -> "DFlashDrafter":
    """Binds drafter weights to a target (shared embedding and LM head), checking sizes.

    `draft_vocab` (target ids) restricts drafting to those ids (their rows of the target's
    head); a config with a reduced draft_vocab_size needs it.
    """
    check_target(
      target,
      hidden_size=config.hidden_size,
      target_hidden_size=config.target_hidden_size,
      vocab_size=config.vocab_size,
      tap_ids=config.target_layer_ids,
      what="DFlash",
    )
    vocab = target.config.vocab_size
    if not 0 <= config.mask_token_id < vocab:
      raise InputError(
        f"DFlash mask_token_id {config.mask_token_id} is outside the target vocabulary ({vocab})"
      )
    configured = config.draft_vocab_size if config.reduced_vocab else 0
    ids = features.draft_vocab_ids(draft_vocab, vocab, configured, "DFlash")
    config = config.replace(
      vocab_size=vocab,
      draft_vocab_size=0 if ids is None else int(ids.size),
      num_target_layers=target.config.num_layers,
      dtype=target.config.dtype,
      embed_scale=target.config.embedding_scale,
    )
    params = {"draft": draft_params, **shared_target_params(target)}
    if config.reduced_vocab:
      params.update(features.draft_head_params(params, ids, config.dtype))
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
    draft_vocab: Optional[Any] = None,
    seed: int = 0,
    stddev: float = 0.02,
    **kwargs: Any,
  ) -> "DFlashDrafter":
    """A freshly initialised drafter for `target` (sizes default to the target's; the mask id to
    the target tokenizer's mask token; `draft_vocab`: target ids that drafting is limited to)."""
    if mask_token_id is None:
      mask_token_id = getattr(target.tokenizer, "mask_id", None)
      if mask_token_id is None:
        raise ConfigError(
          "DFlash needs a mask token: pass mask_token_id (the target has no tokenizer with one)"
        )
    n = target.config.num_layers
    config = DFlashConfig(
      **features.sized_like(
        target,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
      ),
      num_layers=num_layers,
      target_layer_ids=target_layer_ids or build_target_layer_ids(n, num_layers),
      mask_token_id=mask_token_id,
      block_size=block_size,
      num_target_layers=n,
      layer_windows=layer_windows,
    )
    return cls.for_target(
      target, config, init_params(config, seed, stddev), draft_vocab=draft_vocab, **kwargs
    )

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
    if "draft_vocab" in self.params:
      axes["draft_vocab"] = PartitionSpec(None)
      axes["draft_head"] = PartitionSpec("vocab", "embed")
    return axes

  @property
  def block_len(self) -> int:
    return self.gamma + 1

  def capacity(self, max_len: int) -> int:
    return min(self.context_window, max_len) if self.context_window else max_len

  def init_state(self, params: Any, batch: int, max_len: int) -> DFlashState:
    del params
    c = self.config
    return ContextRing.create(c, c.num_layers, batch, self.capacity(max_len), self.context_window)

  def _write_context(
    self, params: Any, state: DFlashState, taps: jax.Array, start: jax.Array, limit: jax.Array
  ) -> DFlashState:
    """Appends the K/V of target features taps [n_taps, B, T, H] at positions start[b]..,
    those < limit [B] (the ring keeps the last C of them)."""
    positions = start[:, None] + jnp.arange(taps.shape[2], dtype=jnp.int32)[None]
    k, v = DFlashModel(self.config).apply(
      {"params": params["draft"]}, concat_taps(taps), positions, method=DFlashModel.context_kv
    )
    return state.append(start, k, v, limit)

  def prefill(self, params: Any, state: DFlashState, ctx: PrefillContext) -> DFlashState:
    start = jnp.broadcast_to(ctx.first, ctx.prompt_lens.shape)
    return self._write_context(params, state, ctx.taps, start, ctx.prompt_lens)

  def block_logits(
    self, params: Any, state: DFlashState, block: jax.Array, start: jax.Array
  ) -> jax.Array:
    """Drafter logits [B, T, V_d] of a block [B, T] at positions start..start+T−1, attending to
    the stored context before `start` (read in chunks of `context_chunk` live slots); V_d is
    the draft vocabulary (the target's whole one without)."""
    c = self.config
    t = block.shape[1]
    x = embed_tokens(params, block, c.dtype, c.embed_scale)[:, None]
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
    return features.draft_logits(params, h[:, 0], c.dtype)

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
    logits = self.block_logits(params, state, block, start)[:, 1:]  # [B, γ, V_d]
    vocab = self.config.vocab_size
    # Drafts, q and log-probs in target ids (q zero and log-probs NEG_INF off a draft vocabulary).
    logprobs = features.to_target_vocab(params, tree_logprobs(logits, ctx.sampling), vocab, NEG_INF)
    if self.sample_drafts:

      def sampled():
        q = sampling.warped_probs(logits, ctx.sampling)
        idx = sampling.sample_from_probs(ctx.key, q)
        return features.draft_to_target_ids(params, idx), features.to_target_vocab(
          params, q, vocab, 0.0
        )

      def greedy():  # the same drafts and q, without the vocabulary-wide draw
        ids = features.draft_to_target_ids(params, sampling.argmax(logits))
        return ids, jax.nn.one_hot(ids, vocab, dtype=jnp.float32)

      drafts, q = jax.lax.cond(jnp.all(sampling.is_greedy(ctx.sampling)), greedy, sampled)
      return Proposal(drafts, q, logprobs), state
    drafts = features.draft_to_target_ids(params, sampling.argmax(logits))
    return Proposal(drafts, None, logprobs), state

  def commit(self, params: Any, state: DFlashState, ctx: CommitContext) -> DFlashState:
    # Features exist for every committed position before the new bonus token.
    return self._write_context(params, state, ctx.taps, ctx.old_seq_len - 1, ctx.seq_len - 1)

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
      {"params": params["draft"]}, concat_taps(taps), pos, method=DFlashModel.context_kv
    )
    first = jnp.take_along_axis(tokens, jnp.clip(anchors, 0, s - 1), axis=1)
    n = anchors.shape[1]
    block = jnp.concatenate(
      [first[..., None], jnp.full((b, n, bs - 1), c.mask_token_id, jnp.int32)], axis=-1
    )
    x = embed_tokens(params, block, c.dtype, c.embed_scale)
    q_pos = anchors[..., None] + jnp.arange(bs, dtype=jnp.int32)
    return model.apply(
      {"params": params["draft"]}, x, q_pos, k, v, pos, anchors, self.context_window
    )


# --------------------------------------------------------------------------------------------------
# Published checkpoints (read and written by jaxspec.io.drafter_ckpt)
# --------------------------------------------------------------------------------------------------


def load_dflash(
  model_dir: str, target: TargetModel, draft_vocab: Optional[Any] = None, **kwargs: Any
) -> DFlashDrafter:
  """A published DFlash checkpoint (z-lab layout) bound to `target`; sizes, vocabulary and
  tapped layers are checked. `draft_vocab` (target ids) replaces the checkpoint's draft
  vocabulary (none: the whole one), e.g. to draft a large-vocabulary target's frequent tokens
  only. `kwargs` go to DFlashDrafter (gamma, sample_drafts, ...)."""
  ckpt = drafter_ckpt.load_dflash(model_dir, DFlashConfig, param_shapes)
  params = jax.tree_util.tree_map(jnp.asarray, ckpt.params)
  config = ckpt.config
  if draft_vocab is None and ckpt.vocab_maps is not None:
    d2t = ckpt.vocab_maps["d2t"]
    draft_vocab = np.arange(d2t.shape[0]) + d2t
  elif draft_vocab is not None:
    config = config.replace(draft_vocab_size=0)
  return DFlashDrafter.for_target(
    target, config, params, draft_vocab=draft_vocab, hf_config=ckpt.hf_config, **kwargs
  )


def _d2t(drafter: DFlashDrafter) -> Optional[np.ndarray]:
  """The draft vocabulary as EAGLE-3's d2t offsets (None without one)."""
  if "draft_vocab" not in drafter.params:
    return None
  ids = np.asarray(drafter.params["draft_vocab"], np.int64)
  return ids - np.arange(ids.size, dtype=np.int64)


def dflash_tensors(drafter: DFlashDrafter) -> dict[str, np.ndarray]:
  """The drafter's weights (and draft vocabulary maps) under their published names."""
  return drafter_ckpt.dflash_tensors(drafter.config, drafter.params["draft"], _d2t(drafter))


def save_dflash(drafter: DFlashDrafter, out_dir: str) -> None:
  """Writes config.json and model.safetensors in the published DFlash layout."""
  drafter_ckpt.save_dflash(
    out_dir, drafter.config, drafter.params["draft"], drafter.hf_config, _d2t(drafter)
  )
