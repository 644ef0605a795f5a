"""EAGLE-3: one decoder layer over fused low/middle/high target features, chained γ steps.

Architecture (SafeAILab/EAGLE `eagle/model/cnets.py` and SpecForge `LlamaForCausalLMEagle3`; see
docs/drafters.md):

- features: the hidden states entering target layers 2, L//2 and L−3 (= the outputs of layers
  1, L//2−1, L−4, HF hidden_states[id + 1]), concatenated to 3·H_t and fused by
  `fc` = Linear(3·H_t → H, no bias) (optionally after one RMSNorm per chunk, SpecForge `fc_norm`);
- `midlayer`: one Llama layer whose attention reads [input_layernorm(embed(t_{i+1}));
  hidden_norm(f_i)] (2H wide q/k/v projections, no q/k norms), with the residual taken from the
  (unnormalised) feature f_i, then post-attention norm and SwiGLU MLP;
- `norm` then the drafter's own `lm_head` over a draft vocabulary of `draft_vocab_size` tokens;
  draft id d means target id d + d2t[d] (`t2d` marks the target ids that have a draft id).

Position i of the drafter reads (f_i, t_{i+1}) at RoPE position i and predicts t_{i+2}. To draft
γ tokens from the root at slot n: step 0 reads (f_{n−1}, root) at position n−1; step j reads its
own previous output hidden (before `norm`) beside draft j at position n−1+j (training-time
test, `jaxspec.train.drafter_losses.eagle3_ttt_loss`, trains exactly this). The chain's loop is
`jaxspec.drafters.feature_chain`, shared with MTP; checkpoints are read and written by
`jaxspec.io.drafter_ckpt`.

State: the layer's KV cache and the fused feature of the slot before the root. Cache
invariant (as for MTP): entries below n−1 hold (target feature, true token); propose writes n−1
and scratch after it; commit rewrites the entries of newly committed positions. With
`context_window` = N (default 4096) a draft chain sees only the N most recent committed entries
(and its own), and the cache is a ring of N + γ + 1 slots (`jaxspec.state.RingKV`): memory O(N)
however long the text; 0 keeps a full-length cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Optional

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from jaxspec.config import ConfigError, ModelConfig
from jaxspec.drafters import feature_chain, features
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.drafters.base import check_gamma
from jaxspec.drafters.features import DEFAULT_CONTEXT_WINDOW
from jaxspec.io import drafter_ckpt
from jaxspec.io.drafter_ckpt import check_vocab_maps, make_vocab_maps  # noqa: F401 (re-exported)
from jaxspec.models import attention as attention_lib
from jaxspec.models.attention import NEG_INF
from jaxspec.models.layers import MLP, Dense, RMSNorm, apply_rope, dtype_of, rope_tables
from jaxspec.models.layers import unfused_logits
from jaxspec.models.target import InputError, TargetModel
from jaxspec.state import NO_LIMIT, FloatKV, RingKV

# EAGLE-3's taps (as layer outputs) when a checkpoint names none: the inputs of layers 2, L//2
# and L−3.
default_layer_ids = drafter_ckpt.eagle3_default_layer_ids


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
  """Architecture of an EAGLE-3 drafter.

  vocab_size: the target vocabulary; draft_vocab_size ≤ vocab_size is the drafter's own head.
  has_embedding: the checkpoint carries its own `embed_tokens` (else the target's is shared).
  """

  hidden_size: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate_size: int
  target_layer_ids: tuple[int, ...]
  vocab_size: int
  draft_vocab_size: int = 0
  target_hidden_size: int = 0
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # RoPE scaling as ModelConfig.rope_scaling (() = none; llama3 in Llama-3.1 heads).
  rope_scaling: tuple[tuple[str, Any], ...] = ()
  fc_norm: bool = False
  norm_output: bool = True
  has_embedding: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  # The target's embedding scale (ModelConfig.embedding_scale), applied to rows of the
  # target's table; set from the target with dtype, not part of the checkpoint.
  embed_scale: float = 1.0

  def __post_init__(self):
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    if not self.draft_vocab_size:
      object.__setattr__(self, "draft_vocab_size", self.vocab_size)
    if not self.target_hidden_size:
      object.__setattr__(self, "target_hidden_size", self.hidden_size)
    sizes = ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")
    need = features.check_layer_sizes(self, "EAGLE-3", sizes + ("vocab_size",))
    need(
      len(self.target_layer_ids) == 3 and all(i >= 0 for i in self.target_layer_ids),
      f"needs exactly three non-negative target layer ids, got {list(self.target_layer_ids)}",
    )
    need(
      0 < self.draft_vocab_size <= self.vocab_size,
      f"draft_vocab_size ({self.draft_vocab_size}) must be in [1, vocab_size={self.vocab_size}]",
    )

  @property
  def reduced_vocab(self) -> bool:
    return self.draft_vocab_size != self.vocab_size

  def body(self) -> ModelConfig:
    """The Qwen3-shaped config of the one layer (no q/k norms)."""
    return features.layer_config(self, vocab_size=self.vocab_size, num_layers=1, qk_norm=False)

  def replace(self, **changes: Any) -> "Eagle3Config":
    return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------------------
# The network
# --------------------------------------------------------------------------------------------------


class Eagle3Attention(nn.Module):
  """Llama GQA attention whose q/k/v read the 2H-wide [emb; hidden] input."""

  config: ModelConfig

  def setup(self):
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    self.q_proj = Dense((c.num_heads, c.head_dim), ("embed", "heads", "head_dim"), **dense)
    self.k_proj = Dense((c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), **dense)
    self.v_proj = Dense((c.num_kv_heads, c.head_dim), ("embed", "kv_heads", "head_dim"), **dense)
    self.o_proj = Dense((c.hidden_size,), ("heads", "head_dim", "embed"), in_dims=2, **dense)

  def qkv(self, x: jax.Array, cos: jax.Array, sin: jax.Array):
    return (
      apply_rope(self.q_proj(x), cos, sin),
      apply_rope(self.k_proj(x), cos, sin),
      self.v_proj(x),
    )

  def output(self, o: jax.Array) -> jax.Array:
    return self.o_proj(o)


class Eagle3Layer(nn.Module):
  """The EAGLE-3 `midlayer`."""

  config: ModelConfig

  def setup(self):
    c = self.config
    norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)
    self.input_layernorm = norm()
    self.hidden_norm = norm()
    self.post_attention_layernorm = norm()
    self.self_attn = Eagle3Attention(c)
    self.mlp = MLP(c, c.intermediate_size)

  def attn_input(self, emb: jax.Array, hidden: jax.Array) -> jax.Array:
    return jnp.concatenate([self.input_layernorm(emb), self.hidden_norm(hidden)], axis=-1)

  def finish(self, hidden: jax.Array, attn: jax.Array) -> jax.Array:
    """Residual on the feature, then the MLP block."""
    h = hidden + self.self_attn.output(attn)
    return h + self.mlp(self.post_attention_layernorm(h))

  def __call__(
    self,
    emb: jax.Array,
    hidden: jax.Array,
    kv: Any,
    start: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
  ):
    """A causal block: writes its K/V at slots start.. of the one-layer state entry `kv` (or
    attends within the block when None) and reads the prefix chunk by chunk."""
    c = self.config
    q, k, v = self.self_attn.qkv(self.attn_input(emb, hidden), cos, sin)
    out, kv = attention_lib.attention(q, k, v, kv, jnp.int32(0), start, None, c.head_dim**-0.5)
    return self.finish(hidden, out), kv


class Eagle3Model(nn.Module):
  """Parameters: fc, [fc_norm_{0,1,2}], midlayer, norm, lm_head, [embed]."""

  config: Eagle3Config

  def setup(self):
    c = self.config
    body = c.body()
    self.fc = Dense((c.hidden_size,), ("mlp", "embed"), dtype=c.dtype, param_dtype=c.param_dtype)
    if c.fc_norm:
      self.fc_norms = [
        RMSNorm(c.target_hidden_size, c.rms_norm_eps, "embed", c.param_dtype, name=f"fc_norm_{i}")
        for i in range(3)
      ]
    self.midlayer = Eagle3Layer(body)
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype)
    self.lm_head = Dense(
      (c.draft_vocab_size,), ("embed", "vocab"), dtype=c.dtype, param_dtype=c.param_dtype
    )
    if c.has_embedding:
      self.embed = self.param(
        "embed",
        nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
        (c.vocab_size, c.hidden_size),
        dtype_of(c.param_dtype),
      )

  def fuse(self, feats: jax.Array) -> jax.Array:
    """[B, T, 3·H_t] concatenated taps → [B, T, H]."""
    c = self.config
    feats = feats.astype(dtype_of(c.dtype))
    if c.fc_norm:
      chunks = jnp.split(feats, 3, axis=-1)
      feats = jnp.concatenate([n(x) for n, x in zip(self.fc_norms, chunks)], axis=-1)
    return self.fc(feats)

  def logits(self, h: jax.Array) -> jax.Array:
    """Draft-vocabulary logits (float32) of midlayer outputs."""
    return unfused_logits(
      self.lm_head(self.norm(h) if self.config.norm_output else h).astype(jnp.float32)
    )

  def _rope(self, positions: jax.Array):
    c = self.config
    return rope_tables(positions, c.head_dim, c.rope_theta, c.rope_scaling)

  def __call__(self, emb: jax.Array, hidden: jax.Array, kv: Any, start: jax.Array):
    """A causal block of (emb, hidden) pairs at positions start.. → (h, logits, kv)."""
    t = emb.shape[1]
    cos, sin = self._rope(start[:, None] + jnp.arange(t, dtype=jnp.int32)[None])
    h, kv = self.midlayer(emb, hidden, kv, start, cos, sin)
    return h, self.logits(h), kv

  def ttt(self, emb_steps: jax.Array, feats: jax.Array) -> tuple[jax.Array, ...]:
    """Training-time test: `steps` logits [B, S, V_d] of the chain unrolled over every position.

    emb_steps [steps, B, S, H]: step j's token embeddings (position i holds t_{i+j+1});
    feats [B, S, 3·H_t]. Step 0 reads the fused target features; step j > 0 its own previous
    outputs. A step-j query at position i (RoPE position i + j) attends to the step-0 keys at
    positions ≤ i and to the step-1..j keys of the same i, which is what the inference chain
    from the root at i + 1 sees.
    """
    c = self.config
    steps, b, s, _ = emb_steps.shape
    layer = self.midlayer
    hidden = self.fuse(feats)
    base = jnp.arange(s, dtype=jnp.int32)[None]
    causal = base[0][:, None] >= base[0][None, :]  # [S_q, S_k]
    kv, g = c.num_kv_heads, c.num_heads // c.num_kv_heads
    scale = c.head_dim**-0.5
    k0 = v0 = None
    diag_k, diag_v, out = [], [], []
    for j in range(steps):
      cos, sin = self._rope(jnp.broadcast_to(base + j, (b, s)))
      q, k, v = layer.self_attn.qkv(layer.attn_input(emb_steps[j], hidden), cos, sin)
      qg = q.reshape(b, s, kv, g, c.head_dim)
      if j == 0:
        k0, v0 = k, v
      else:
        diag_k.append(k)
        diag_v.append(v)
      s0 = jnp.einsum("bskgd,btkd->bkgst", qg, k0, preferred_element_type=jnp.float32) * scale
      s0 = jnp.where(causal[None, None, None], s0, NEG_INF)
      sd = [
        jnp.einsum("bskgd,bskd->bkgs", qg, kd, preferred_element_type=jnp.float32)[..., None]
        * scale
        for kd in diag_k
      ]
      probs = jax.nn.softmax(jnp.concatenate([s0] + sd, axis=-1), axis=-1)
      o = jnp.einsum(
        "bkgst,btkd->bskgd", probs[..., :s].astype(q.dtype), v0, preferred_element_type=jnp.float32
      )
      for i, vd in enumerate(diag_v):
        o = o + probs[..., s + i].transpose(0, 3, 1, 2)[..., None] * vd[:, :, :, None, :]
      hidden = layer.finish(hidden, o.reshape(b, s, c.num_heads, c.head_dim).astype(q.dtype))
      out.append(self.logits(hidden))
    # A tuple, not a stacked array: the loss slices each step, and the backward pass of
    # slices of one stacked [steps, B, S, V] array pads every cotangent to the full stack
    # (measured 5× slower training steps on CPU).
    return tuple(out)

  def init_all(self, feats: jax.Array, emb: jax.Array):
    b = emb.shape[0]
    h, logits, _ = self(emb, self.fuse(feats), None, jnp.zeros((b,), jnp.int32))
    if self.config.has_embedding:
      logits = logits + jnp.sum(self.embed) * 0
    return logits


def _abstract(config: Eagle3Config) -> Any:
  feats = jnp.zeros((1, 1, 3 * config.target_hidden_size), jnp.float32)
  emb = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
  return features.abstract_params(Eagle3Model(config), Eagle3Model.init_all, feats, emb)


def param_shapes(config: Eagle3Config) -> Any:
  return nn.meta.unbox(_abstract(config)["params"])


def logical_axes(config: Eagle3Config) -> Any:
  return nn.get_partition_spec(_abstract(config))["params"]


def init_params(config: Eagle3Config, seed: int = 0, stddev: float = 0.02) -> Any:
  """Random parameters (`features.random_params`)."""
  return features.random_params(param_shapes(config), seed, stddev)


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Eagle3State:
  kv: Any  # the draft layer's K/V: FloatKV [1, B, L, K, D] or RingKV [1, B, N + γ + 1, K, D]
  last_feature: jax.Array  # [B, H] fused target feature at slot seq_len − 2

  AXES: ClassVar[dict] = {"last_feature": ("batch", "embed")}  # kv names its own


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Drafter):
  """EAGLE-3 behind the Drafter protocol (chain drafting; per-position log-probs for trees).

  params: {"draft": Eagle3Model parameters, "d2t": [V_d] int32 target-id offsets (reduced
    vocabulary only), "embed" (the target's, unless the drafter has its own)}.
  sample_drafts: at T > 0 draw each draft from the warped draft distribution q (returned over
    the target vocabulary for lossless verification); False drafts the argmax (q one-hot).
  `logprobs` (for tree verification) are log_softmax(logits / T) in target ids, −inf outside
  the draft vocabulary.
  context_window: a chain sees only this many most recent committed entries (its K/V cache is
    a ring of context_window + γ + 1 slots); 0 keeps every one.
  """

  config: Eagle3Config = None  # type: ignore[assignment]
  gamma: int = 4
  sample_drafts: bool = True
  context_window: int = DEFAULT_CONTEXT_WINDOW
  hf_config: Optional[dict] = dataclasses.field(default=None, compare=False, hash=False, repr=False)
  # The checkpoint's own d2t (int64) / t2d (bool) arrays, kept for an exact export.
  vocab_maps: Optional[dict] = dataclasses.field(
    default=None, compare=False, hash=False, repr=False
  )

  def __post_init__(self):
    if self.config is None:
      raise ConfigError("Eagle3Drafter needs an Eagle3Config")
    check_gamma("Eagle3Drafter", self.gamma)
    ok = isinstance(self.context_window, int) and self.context_window >= 0
    if not ok:
      raise ConfigError(f"context_window must be an integer ≥ 0, got {self.context_window!r}")

  @classmethod
  def for_target(
    cls,
    target: TargetModel,
    config: Eagle3Config,
    draft_params: Any,
    d2t: Optional[Any] = None,
    **kwargs: Any,
  ) -> "Eagle3Drafter":
    """Binds weights to a target (shared embedding unless the drafter has its own)."""
    features.check_target(
      target,
      hidden_size=(target.config.hidden_size if config.has_embedding else config.hidden_size),
      target_hidden_size=config.target_hidden_size,
      vocab_size=config.vocab_size,
      tap_ids=config.target_layer_ids,
      what="EAGLE-3",
    )
    config = config.replace(dtype=target.config.dtype, embed_scale=target.config.embedding_scale)
    params: dict = {"draft": draft_params}
    if not config.has_embedding:
      params["embed"] = features.shared_target_params(target)["embed"]
    if config.reduced_vocab:
      if d2t is None:
        raise InputError("an EAGLE-3 drafter with a reduced vocabulary needs its d2t map")
      params["d2t"] = jnp.asarray(np.asarray(d2t, np.int64).astype(np.int32))
    return cls(params=params, config=config, **kwargs)

  @classmethod
  def random(
    cls,
    target: TargetModel,
    *,
    draft_vocab: Optional[Any] = None,
    target_layer_ids: Optional[tuple[int, ...]] = None,
    num_heads: Optional[int] = None,
    num_kv_heads: Optional[int] = None,
    head_dim: Optional[int] = None,
    intermediate_size: Optional[int] = None,
    seed: int = 0,
    stddev: float = 0.02,
    **kwargs: Any,
  ) -> "Eagle3Drafter":
    """A freshly initialised drafter; `draft_vocab` (target ids) makes a reduced vocabulary."""
    tc = target.config
    d2t = None
    draft_vocab_size = tc.vocab_size
    if draft_vocab is not None:
      d2t, _ = make_vocab_maps(draft_vocab, tc.vocab_size)
      draft_vocab_size = d2t.shape[0]
    config = Eagle3Config(
      **features.sized_like(
        target,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
      ),
      target_layer_ids=target_layer_ids or default_layer_ids(tc.num_layers),
      draft_vocab_size=draft_vocab_size,
    )
    return cls.for_target(target, config, init_params(config, seed, stddev), d2t=d2t, **kwargs)

  # -- protocol ------------------------------------------------------------------------------------

  @property
  def taps(self) -> tuple[int, ...]:
    return self.config.target_layer_ids

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def param_axes(self) -> dict:
    axes: dict = {"draft": logical_axes(self.config)}
    if "embed" in self.params:
      axes["embed"] = PartitionSpec("vocab", "embed")
    if "d2t" in self.params:
      axes["d2t"] = PartitionSpec(None)
    return axes

  def for_tree(self, sampled_chain: bool = False) -> "Eagle3Drafter":
    """Tree verification: the chain follows the argmax (or, for sampled trees, is sampled at
    T > 0), so each depth's log-probs are conditioned on the tree's first branch."""
    return dataclasses.replace(self, sample_drafts=sampled_chain)

  def _model(self) -> Eagle3Model:
    return Eagle3Model(self.config)

  def _embed(self, params: Any, tokens: jax.Array) -> jax.Array:
    if self.config.has_embedding:
      return jnp.take(params["draft"]["embed"], tokens, axis=0).astype(dtype_of(self.config.dtype))
    return features.embed_tokens(params, tokens, self.config.dtype, self.config.embed_scale)

  def to_target_ids(self, params: Any, draft_ids: jax.Array) -> jax.Array:
    if not self.config.reduced_vocab:
      return draft_ids
    return draft_ids + jnp.take(params["d2t"], draft_ids)

  def to_target_vocab(self, params: Any, x: jax.Array, fill: float) -> jax.Array:
    """Scatters [..., V_d] draft-vocabulary values into [..., V] target-vocabulary slots."""
    if not self.config.reduced_vocab:
      return x
    ids = jnp.arange(self.config.draft_vocab_size) + params["d2t"]
    out = jnp.full(x.shape[:-1] + (self.config.vocab_size,), fill, x.dtype)
    return out.at[..., ids].set(x)

  def fuse(self, params: Any, taps: jax.Array) -> jax.Array:
    return self._model().apply(
      {"params": params["draft"]}, features.concat_taps(taps), method=Eagle3Model.fuse
    )

  def forward(
    self,
    params: Any,
    tokens: jax.Array,
    hidden: jax.Array,
    start: jax.Array,
    kv: Any,
  ):
    """Causal block of (token t_{i+1}, hidden f_i) at positions start.. → (h, logits, kv)."""
    return self._model().apply(
      {"params": params["draft"]}, self._embed(params, tokens), hidden, kv, start
    )

  def init_state(self, params: Any, batch: int, max_len: int) -> Eagle3State:
    del params
    c = self.config
    dt = dtype_of(c.dtype)
    cap = self.ring_capacity(max_len)
    if cap:
      kv = RingKV.create(c.body(), 1, batch, cap)
    else:
      kv = FloatKV.create(c.body(), 1, batch, max_len)
    return Eagle3State(kv, jnp.zeros((batch, c.hidden_size), dt))

  def ring_capacity(self, max_len: int) -> int:
    """Ring slots for the cache (0: a full-length cache, when the window would not save any):
    N committed entries plus the γ + 1 a step writes at or after its root's."""
    cap = self.context_window + self.gamma + 1
    return cap if self.context_window and cap < max_len else 0

  def _bounded(self, kv: Any, floor: Any = None, limit: Any = NO_LIMIT) -> Any:
    return kv.with_bounds(floor, limit)  # a full-length cache has no bounds: itself

  def _block(self, params: Any) -> feature_chain.Block:
    """The drafter as the chain's block: (kv, tokens, features, start) → (h, logits, kv)."""
    return lambda kv, tokens, feats, start: self.forward(params, tokens, feats, start, kv)

  def _vocab(self, params: Any) -> Optional[feature_chain.DraftVocab]:
    if not self.config.reduced_vocab:
      return None
    return feature_chain.DraftVocab(
      lambda ids: self.to_target_ids(params, ids),
      lambda x, fill: self.to_target_vocab(params, x, fill),
    )

  def prefill(self, params: Any, state: Eagle3State, ctx: PrefillContext) -> Eagle3State:
    feats = self.fuse(params, ctx.taps)
    kv = self._bounded(state.kv, limit=ctx.prompt_lens)  # padding must not displace entries
    kv, last = feature_chain.prefill(self._block(params), kv, state.last_feature, feats, ctx)
    return Eagle3State(kv, last)

  def propose(
    self, params: Any, state: Eagle3State, ctx: ProposeContext
  ) -> tuple[Proposal, Eagle3State]:
    # The chain starts at position n − 1 (n = seq_len − 1, the root's slot) and sees the
    # context_window committed entries before it.
    kv = self._bounded(state.kv, floor=ctx.seq_len - 2 - self.context_window)
    proposal, kv = feature_chain.propose(
      self._block(params),
      kv,
      state.last_feature,
      ctx,
      self.gamma,
      self.sample_drafts,
      self._vocab(params),
    )
    return proposal, state.replace(kv=kv)

  def commit(self, params: Any, state: Eagle3State, ctx: CommitContext) -> Eagle3State:
    feats = self.fuse(params, ctx.taps)  # [B, γ+1, H]
    kv = self._bounded(state.kv)
    kv, last = feature_chain.commit(
      self._block(params), kv, state.last_feature, feats, ctx, self.gamma
    )
    return Eagle3State(kv, last)

  # -- training form -------------------------------------------------------------------------------

  def ttt_logits(
    self, params: Any, tokens: jax.Array, taps: jax.Array, steps: int = 7
  ) -> tuple[jax.Array, ...]:
    """Training-time-test logits, one [B, S, V_d] per step: step j at position i predicts
    t_{i+j+2} (`np.asarray` of the tuple stacks them)."""
    b, s = tokens.shape
    padded = jnp.pad(tokens, ((0, 0), (0, steps + 1)))
    emb = jnp.stack([self._embed(params, padded[:, j + 1 : j + 1 + s]) for j in range(steps)])
    return self._model().apply(
      {"params": params["draft"]}, emb, features.concat_taps(taps), method=Eagle3Model.ttt
    )


# --------------------------------------------------------------------------------------------------
# Published checkpoints (read and written by jaxspec.io.drafter_ckpt)
# --------------------------------------------------------------------------------------------------


def load_eagle3(model_dir: str, target: TargetModel, **kwargs: Any) -> Eagle3Drafter:
  """A published EAGLE-3 checkpoint (SafeAILab / SpecForge layout) bound to `target`.

  The taps default to the inputs of target layers 2, L//2 and L−3 unless config.json names
  them (`eagle_config.eagle_aux_hidden_state_layer_ids`). `kwargs` go to Eagle3Drafter.
  """
  ckpt = drafter_ckpt.load_eagle3(model_dir, Eagle3Config, param_shapes, target.config.num_layers)
  maps = ckpt.vocab_maps
  return Eagle3Drafter.for_target(
    target,
    ckpt.config,
    jax.tree_util.tree_map(jnp.asarray, ckpt.params),
    d2t=None if maps is None else maps["d2t"],
    hf_config=ckpt.hf_config,
    vocab_maps=maps,
    **kwargs,
  )


def eagle3_tensors(drafter: Eagle3Drafter) -> dict[str, np.ndarray]:
  """The drafter's weights (and d2t/t2d) under their published names."""
  p = drafter.params
  return drafter_ckpt.eagle3_tensors(drafter.config, p["draft"], p.get("d2t"), drafter.vocab_maps)


def save_eagle3(drafter: Eagle3Drafter, out_dir: str) -> None:
  """Writes config.json and model.safetensors in the EAGLE-3 (SpecForge) layout."""
  p = drafter.params
  drafter_ckpt.save_eagle3(
    out_dir, drafter.config, p["draft"], p.get("d2t"), drafter.vocab_maps, drafter.hf_config
  )
