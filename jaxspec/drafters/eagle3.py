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
test, `jaxspec.train.drafter_losses.eagle3_ttt_loss`, trains exactly this).

State: the layer's KV cache and the fused feature of the slot before the root. Cache
invariant (as for MTP): entries below n−1 hold (target feature, true token); propose writes n−1
and scratch after it; commit rewrites the entries of newly committed positions. With
`context_window` = N (default 4096) a draft chain sees only the N most recent committed entries
(and its own), and the cache is a ring of N + γ + 1 slots (`jaxspec.state.RingKV`): memory O(N)
however long the text; 0 keeps a full-length cache.
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
from jaxspec.drafters.dflash import DEFAULT_CONTEXT_WINDOW, check_target, shared_target_params
from jaxspec.drafters.mtp import tree_logprobs
from jaxspec.io import drafter_ckpt
from jaxspec.io.hf import CheckpointError, read_config
from jaxspec.models import attention as attention_lib
from jaxspec.models.attention import NEG_INF
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
from jaxspec.state import NO_LIMIT, FloatKV, RingKV


def default_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
  """EAGLE-3's taps (as layer outputs): the inputs of layers 2, L//2 and L−3."""
  return (1, num_target_layers // 2 - 1, num_target_layers - 4)


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
  fc_norm: bool = False
  norm_output: bool = True
  has_embedding: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))
    if not self.draft_vocab_size:
      object.__setattr__(self, "draft_vocab_size", self.vocab_size)
    if not self.target_hidden_size:
      object.__setattr__(self, "target_hidden_size", self.hidden_size)

    def need(cond: bool, msg: str) -> None:
      if not cond:
        raise ConfigError(f"EAGLE-3 drafter: {msg}")

    for name in (
      "hidden_size",
      "num_heads",
      "num_kv_heads",
      "head_dim",
      "intermediate_size",
      "vocab_size",
    ):
      need(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
    need(
      self.num_heads % self.num_kv_heads == 0,
      f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
      f"({self.num_kv_heads})",
    )
    need(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
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
    return ModelConfig(
      architecture="Qwen3ForCausalLM",
      vocab_size=self.vocab_size,
      hidden_size=self.hidden_size,
      num_layers=1,
      num_heads=self.num_heads,
      num_kv_heads=self.num_kv_heads,
      head_dim=self.head_dim,
      intermediate_size=self.intermediate_size,
      rms_norm_eps=self.rms_norm_eps,
      rope_theta=self.rope_theta,
      qk_norm=False,
      options=RunOptions(dtype=self.dtype, param_dtype=self.param_dtype),
    )

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
    return rope_tables(positions, self.config.head_dim, self.config.rope_theta)

  def __call__(
    self,
    emb: jax.Array,
    hidden: jax.Array,
    kv: Any,
    start: jax.Array,
  ):
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


def _abstract(config: Eagle3Config):
  feats = jnp.zeros((1, 1, 3 * config.target_hidden_size), jnp.float32)
  emb = jnp.zeros((1, 1, config.hidden_size), jnp.float32)
  return jax.eval_shape(
    lambda: Eagle3Model(config).init(jax.random.PRNGKey(0), feats, emb, method=Eagle3Model.init_all)
  )


def param_shapes(config: Eagle3Config) -> Any:
  return nn.meta.unbox(_abstract(config)["params"])


def logical_axes(config: Eagle3Config) -> Any:
  return nn.get_partition_spec(_abstract(config))["params"]


def init_params(config: Eagle3Config, seed: int = 0, stddev: float = 0.02) -> Any:
  rng = np.random.default_rng(seed)

  def make(path, leaf):
    if "scale" in jax.tree_util.keystr(path):
      return jnp.ones(leaf.shape, leaf.dtype)
    return jnp.asarray(rng.normal(0.0, stddev, leaf.shape), leaf.dtype)

  return jax.tree_util.tree_map_with_path(make, param_shapes(config))


# --------------------------------------------------------------------------------------------------
# Vocabulary maps
# --------------------------------------------------------------------------------------------------


def make_vocab_maps(used_target_ids: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
  """(d2t [V_d] int64 offsets, t2d [V] bool) for a draft vocabulary of the given target ids."""
  ids = np.sort(np.unique(np.asarray(used_target_ids, np.int64)))
  if ids.size == 0 or ids[0] < 0 or ids[-1] >= vocab_size:
    raise ConfigError(f"draft vocabulary ids must lie in [0, {vocab_size})")
  t2d = np.zeros((vocab_size,), bool)
  t2d[ids] = True
  return ids - np.arange(ids.size, dtype=np.int64), t2d


def check_vocab_maps(
  d2t: np.ndarray, t2d: np.ndarray, vocab_size: int, draft_vocab_size: int
) -> None:
  """Raises CheckpointError unless d2t/t2d describe the same injective draft → target map."""
  d2t, t2d = np.asarray(d2t), np.asarray(t2d)
  if d2t.shape != (draft_vocab_size,) or t2d.shape != (vocab_size,):
    raise CheckpointError(
      f"d2t must be [{draft_vocab_size}] and t2d [{vocab_size}], got "
      f"{list(d2t.shape)} and {list(t2d.shape)}"
    )
  target_ids = np.arange(draft_vocab_size) + d2t.astype(np.int64)
  if target_ids.min() < 0 or target_ids.max() >= vocab_size:
    raise CheckpointError(f"d2t maps draft ids outside the target vocabulary [0, {vocab_size})")
  if len(np.unique(target_ids)) != draft_vocab_size:
    raise CheckpointError("d2t maps two draft ids to the same target id")
  if not np.array_equal(np.flatnonzero(t2d.astype(bool)), np.sort(target_ids)):
    raise CheckpointError("t2d does not mark exactly the target ids that d2t maps to")


# --------------------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------------------


@flax.struct.dataclass
class Eagle3State:
  kv: Any  # the draft layer's K/V: FloatKV [1, B, L, K, D] or RingKV [1, B, N + γ + 1, K, D]
  last_feature: jax.Array  # [B, H] fused target feature at slot seq_len − 2

  AXES: ClassVar[dict] = {"last_feature": ("batch", "embed")}  # kv names its own


def _concat_taps(taps: jax.Array) -> jax.Array:
  n, b, t, h = taps.shape
  return jnp.moveaxis(taps, 0, 2).reshape(b, t, n * h)


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
    check_target(
      target,
      hidden_size=(target.config.hidden_size if config.has_embedding else config.hidden_size),
      target_hidden_size=config.target_hidden_size,
      vocab_size=config.vocab_size,
      tap_ids=config.target_layer_ids,
      what="EAGLE-3",
    )
    config = config.replace(dtype=target.config.dtype)
    params: dict = {"draft": draft_params}
    if not config.has_embedding:
      params["embed"] = shared_target_params(target)["embed"]
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
      hidden_size=tc.hidden_size,
      num_heads=num_heads or tc.num_heads,
      num_kv_heads=num_kv_heads or tc.num_kv_heads,
      head_dim=head_dim or tc.head_dim,
      intermediate_size=intermediate_size or tc.intermediate_size,
      target_layer_ids=target_layer_ids or default_layer_ids(tc.num_layers),
      vocab_size=tc.vocab_size,
      draft_vocab_size=draft_vocab_size,
      target_hidden_size=tc.hidden_size,
      rms_norm_eps=tc.rms_norm_eps,
      rope_theta=tc.rope_theta,
      dtype=tc.dtype,
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

  def for_tree(self) -> "Eagle3Drafter":
    """Tree verification: the chain follows the argmax, so each depth's log-probs are
    conditioned on the tree's top-1 branch."""
    return dataclasses.replace(self, sample_drafts=False)

  def _model(self) -> Eagle3Model:
    return Eagle3Model(self.config)

  def _embed(self, params: Any, tokens: jax.Array) -> jax.Array:
    table = params["draft"]["embed"] if self.config.has_embedding else params["embed"]
    return jnp.take(table, tokens, axis=0).astype(dtype_of(self.config.dtype))

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
      {"params": params["draft"]}, _concat_taps(taps), method=Eagle3Model.fuse
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
    return kv.with_bounds(floor, limit) if isinstance(kv, RingKV) else kv

  def prefill(self, params: Any, state: Eagle3State, ctx: PrefillContext) -> Eagle3State:
    feats = self.fuse(params, ctx.taps)
    start = jnp.full(ctx.prompt_lens.shape, ctx.first)
    kv = self._bounded(state.kv, limit=ctx.prompt_lens)  # padding must not displace entries
    _, _, kv = self.forward(params, ctx.shifted_tokens(1), feats, start, kv)
    return Eagle3State(kv, ctx.at_last(feats, state.last_feature))

  def propose(
    self, params: Any, state: Eagle3State, ctx: ProposeContext
  ) -> tuple[Proposal, Eagle3State]:
    rows = jnp.arange(ctx.tokens.shape[0])
    root = ctx.tokens[rows, ctx.seq_len - 1]
    keys = sampling.split_key(ctx.key, self.gamma)

    def step(carry, key):
      kv, tok, hidden, pos = carry
      h, logits, kv = self.forward(params, tok[:, None], hidden[:, None], pos, kv)
      logits = logits[:, 0]
      if self.sample_drafts:
        q = sampling.warped_probs(logits, ctx.sampling)
        draft_id = sampling.sample_from_probs(key, q)
        q = self.to_target_vocab(params, q, 0.0)
      else:
        draft_id, q = sampling.argmax(logits), None
      lp = self.to_target_vocab(params, tree_logprobs(logits, ctx.sampling), -jnp.inf)
      nxt = self.to_target_ids(params, draft_id).astype(jnp.int32)
      out = (nxt, lp) + ((q,) if q is not None else ())
      return (kv, nxt, h[:, 0].astype(hidden.dtype), pos + 1), out

    # The chain starts at position n − 1 (n = seq_len − 1, the root's slot) and sees the
    # context_window committed entries before it.
    kv = self._bounded(state.kv, floor=ctx.seq_len - 2 - self.context_window)
    init = (kv, root, state.last_feature, ctx.seq_len - 2)
    (kv, _, _, _), outs = jax.lax.scan(step, init, keys)
    tokens = jnp.moveaxis(outs[0], 0, 1)
    logprobs = jnp.moveaxis(outs[1], 0, 1)
    probs = jnp.moveaxis(outs[2], 0, 1) if self.sample_drafts else None
    return Proposal(tokens, probs, logprobs), state.replace(kv=kv)

  def commit(self, params: Any, state: Eagle3State, ctx: CommitContext) -> Eagle3State:
    b, max_len = ctx.tokens.shape
    rows = jnp.arange(b)
    start = ctx.old_seq_len - 1
    feats = self.fuse(params, ctx.taps)  # [B, γ+1, H]
    idx = jnp.minimum(start[:, None] + 1 + jnp.arange(self.gamma)[None, :], max_len - 1)
    tokens = jnp.take_along_axis(ctx.tokens, idx, axis=1)
    kv = self._bounded(state.kv)
    _, _, kv = self.forward(params, tokens, feats[:, : self.gamma], start, kv)
    count = ctx.seq_len - ctx.old_seq_len
    last = feats[rows, jnp.maximum(count - 1, 0)].astype(state.last_feature.dtype)
    last = jnp.where((count > 0)[:, None], last, state.last_feature)
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
      {"params": params["draft"]}, emb, _concat_taps(taps), method=Eagle3Model.ttt
    )


# --------------------------------------------------------------------------------------------------
# Published checkpoints (layout in jaxspec.io.drafter_ckpt)
# --------------------------------------------------------------------------------------------------


def load_eagle3(model_dir: str, target: TargetModel, **kwargs: Any) -> Eagle3Drafter:
  """A published EAGLE-3 checkpoint (SafeAILab / SpecForge layout) bound to `target`.

  The taps default to the inputs of target layers 2, L//2 and L−3 unless config.json names
  them (`eagle_config.eagle_aux_hidden_state_layer_ids`). `kwargs` go to Eagle3Drafter.
  """
  hf = read_config(model_dir)
  names = drafter_ckpt.tensor_names(model_dir)
  fields = drafter_ckpt.eagle3_config_from_hf(
    hf,
    has_embedding="embed_tokens.weight" in names,
    source=os.path.join(model_dir, "config.json"),
  )
  if fields["target_layer_ids"] is None:
    fields["target_layer_ids"] = default_layer_ids(target.config.num_layers)
  config = Eagle3Config(**fields)
  params, raw, dtype = drafter_ckpt.read_checkpoint(
    model_dir,
    list(drafter_ckpt.eagle3_tensor_map(config)),
    param_shapes(config),
    extra=("d2t", "t2d"),
  )
  config = config.replace(param_dtype=dtype)
  d2t, t2d = raw.get("d2t"), raw.get("t2d")
  if config.reduced_vocab and (d2t is None or t2d is None):
    raise CheckpointError(
      f"checkpoint in {model_dir} has a reduced draft vocabulary "
      f"({config.draft_vocab_size} < {config.vocab_size}) but lacks d2t/t2d"
    )
  maps = None
  if d2t is not None or t2d is not None:
    if d2t is None or t2d is None:
      raise CheckpointError(f"checkpoint in {model_dir} has only one of d2t and t2d")
    try:
      check_vocab_maps(d2t, t2d, config.vocab_size, config.draft_vocab_size)
    except ValueError as e:
      raise CheckpointError(f"checkpoint in {model_dir}: {e}") from None
    maps = {"d2t": np.asarray(d2t), "t2d": np.asarray(t2d)}
  params = jax.tree_util.tree_map(jnp.asarray, params)
  return Eagle3Drafter.for_target(
    target, config, params, d2t=d2t, hf_config=hf, vocab_maps=maps, **kwargs
  )


def eagle3_tensors(drafter: Eagle3Drafter) -> dict[str, np.ndarray]:
  """The drafter's weights (and d2t/t2d) under their published names."""
  out = drafter_ckpt.export_tensors(
    drafter_ckpt.eagle3_tensor_map(drafter.config), drafter.params["draft"]
  )
  if drafter.vocab_maps:
    out.update(drafter.vocab_maps)
  elif drafter.config.reduced_vocab:
    d2t = np.asarray(drafter.params["d2t"]).astype(np.int64)
    out["d2t"] = d2t
    out["t2d"] = np.zeros((drafter.config.vocab_size,), bool)
    out["t2d"][np.arange(d2t.shape[0]) + d2t] = True
  return out


def save_eagle3(drafter: Eagle3Drafter, out_dir: str) -> None:
  """Writes config.json and model.safetensors in the EAGLE-3 (SpecForge) layout."""
  drafter_ckpt.write_checkpoint(
    out_dir,
    drafter_ckpt.eagle3_config_to_hf(drafter.config, drafter.hf_config),
    eagle3_tensors(drafter),
  )
