"""Gemma 4's multi-token-prediction assistant (`Gemma4AssistantForCausalLM`) as a drafter.

The assistant has no K/V of its own: each of its layers is a Gemma 4 decoder layer whose
attention reads the target's stored K/V of the last layer of its type (sliding or full) that
computes any (`kv_stores`), straight from the target's decoding state. Each draft step reads
[the target's embedding of the token; a hidden state of the target's width] → `pre_projection`
→ the layers (queries at the root's position, every step: the assistant never writes, so the
position does not advance) → final norm → the logits, and `post_projection` of the normed
output → the hidden state of the next step. Step 0 reads the root beside the target's
final-normed hidden state of the slot before it; the queries see every committed position
(full layers) or the last `sliding_window` + 1 of them (sliding layers: transformers' window
for the assistant), never the root's own slot nor the scratch a verify block left past the
committed length.

The head is the tied embedding table, or the "ordered embedding" head
(`use_ordered_embeddings`): score `num_centroids` clusters of the vocabulary, keep the
`centroid_intermediate_top_k` best and compute logits for their tokens only; every other token
gets (the smallest kept logit − 1), transformers' fill, taken per row and position here
(transformers takes it over its whole batch, which is one row in its assisted generation). At
T > 0 the draft distribution q is the warped softmax of those logits, so sampling stays exact.

Tree verification (`for_tree`) follows the argmax chain; each depth's distribution is the
chain's, as for the MTP drafter (drafters/mtp.py).
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

from jaxspec import sampling
from jaxspec.config import ModelConfig
from jaxspec.drafters import feature_chain
from jaxspec.drafters.base import CommitContext, Drafter, PrefillContext, Proposal, ProposeContext
from jaxspec.drafters.base import check_gamma
from jaxspec.errors import ConfigError
from jaxspec.io import drafter_ckpt
from jaxspec.io import hf as hf_io
from jaxspec.io import tensor_map
from jaxspec.io.architectures import config_from_hf as text_config_from_hf
from jaxspec.io.architectures.reader import HFConfigReader
from jaxspec.models import attention as attention_lib
from jaxspec.models.decoder import DecoderLayer
from jaxspec.models.layers import Dense, RMSNorm, dtype_of, normal_init, rope_tables, scaled_rows
from jaxspec.models.target import InputError, TargetModel

ARCHITECTURE = "Gemma4AssistantForCausalLM"
MODEL_TYPE = "gemma4_assistant"


@dataclasses.dataclass(frozen=True)
class AssistantConfig:
  """The assistant: its layers (`text`, a Gemma 4 text config whose layers are all KV-shared),
  the target width it reads and writes (`backbone_hidden_size`) and its head."""

  text: ModelConfig
  backbone_hidden_size: int
  ordered_head: bool = False
  num_centroids: int = 2048
  centroid_top_k: int = 32

  def __post_init__(self):
    c = self.text
    if c.hidden_size_per_layer_input or c.use_double_wide_mlp or c.final_logit_softcapping:
      raise ConfigError(
        f"{ARCHITECTURE}: per-layer inputs, double-wide MLPs and soft-capping are target-only"
      )
    if self.ordered_head:
      if self.num_centroids < 1 or c.vocab_size % self.num_centroids:
        raise ConfigError(
          f"{ARCHITECTURE}: num_centroids ({self.num_centroids}) must divide the vocabulary "
          f"({c.vocab_size})"
        )
      if not 1 <= self.centroid_top_k <= self.num_centroids:
        raise ConfigError(
          f"{ARCHITECTURE}: centroid_intermediate_top_k ({self.centroid_top_k}) must be in "
          f"[1, num_centroids={self.num_centroids}]"
        )

  @property
  def cluster_size(self) -> int:
    return self.text.vocab_size // self.num_centroids


def kv_stores(config: ModelConfig) -> dict[bool, tuple[int, int]]:
  """Where a Gemma 4 target keeps the K/V its assistant reads: for each layer type (True:
  sliding) the (run, index in the run's entry) of its last layer that computes K/V."""
  first_shared = config.num_layers - config.num_kv_shared_layers
  out = {}
  for layer in range(first_shared):
    run = config.segment_of(layer)
    out[config.is_sliding(layer)] = (run, layer - config.segments()[run][0])
  return out


def shared_sources(target: ModelConfig, target_state: Any, batch: int) -> dict:
  """Layer type (True: sliding) → the SharedSource the assistant's layers of that type attend
  to: the target state's entry of that type's K/V-computing layer (None: no state, as for
  initialising), with an empty block part."""
  out = {}
  dt = jnp.dtype(target.dtype)
  for sliding, (run, index) in kv_stores(target).items():
    heads = target.attention_kv_heads(sliding)
    out[sliding] = attention_lib.SharedSource(
      None,
      None if target_state is None else target_state.segments[run],
      jnp.int32(index),
      jnp.zeros((batch, 1, heads, target.attention_head_dim(sliding)), dt),
      jnp.zeros((batch, 1, heads, target.attention_value_dim(sliding)), dt),
    )
  return out


def ordered_logits(
  h: jax.Array, centroids: jax.Array, ordering: jax.Array, table: jax.Array, top_k: int
) -> jax.Array:
  """The ordered-embedding head: h [B, T, H] → logits [B, T, V] for the tokens of the `top_k`
  best-scoring clusters (`centroids` [H, C]; `ordering` [V]: the vocabulary grouped by cluster,
  C rows of V / C token ids), each other token at (the smallest kept logit − 1). Reads C + top_k
  · V / C rows of the table instead of V."""
  num_clusters = centroids.shape[1]
  dt = table.dtype
  scores = jnp.einsum("bth,hc->btc", h.astype(dt), centroids.astype(dt))
  _, best = jax.lax.top_k(scores.astype(jnp.float32), top_k)  # [B, T, k]
  groups = ordering.reshape(num_clusters, -1)
  ids = groups[best].reshape(*best.shape[:2], -1)  # [B, T, k · V / C]
  rows = jnp.take(table, ids, axis=0)  # [B, T, k · V / C, H]
  kept = jnp.einsum("bth,btnh->btn", h.astype(dt), rows, preferred_element_type=jnp.float32)
  fill = jnp.min(kept, axis=-1, keepdims=True) - 1.0
  out = jnp.broadcast_to(fill, (*kept.shape[:2], table.shape[0]))
  b, t = kept.shape[:2]
  return out.at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None], ids].set(kept)


class AssistantModel(nn.Module):
  """The assistant's forward for one draft step. Parameters: embed (its tied head), layers_{i}
  (Gemma 4 decoder layers, KV-shared), norm, pre_projection, post_projection and, with the
  ordered head, centroids and token_ordering."""

  config: AssistantConfig

  @nn.compact
  def __call__(
    self,
    emb: jax.Array,
    hidden: jax.Array,
    sources: dict,
    positions: jax.Array,
    end: jax.Array,
  ) -> tuple[jax.Array, jax.Array]:
    """emb, hidden [B, 1, Hb] (the token's target embedding, the previous hidden state);
    sources: layer type (True: sliding) → SharedSource over the target's state; positions
    [B, 1] the root's slot; end [B] the first slot not read (the root's). Returns (logits
    [B, 1, V] float32, next hidden [B, 1, Hb])."""
    a = self.config
    c = a.text
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    x = Dense((c.hidden_size,), ("mlp", "embed"), name="pre_projection", **dense)(
      jnp.concatenate([emb, hidden], axis=-1)
    )
    nothing = jnp.zeros((1, 1), bool)  # the step's own (zero) key is never seen
    tables: dict = {}
    for i in range(c.num_layers):
      sliding = c.is_sliding(i)
      spec = c.layer_rope(i)
      if spec not in tables:
        tables[spec] = rope_tables(positions, *spec)
      cos, sin = tables[spec]
      # The last W + 1 committed positions (transformers' bidirectional window of W around
      # the query, flipped to the past): keys p > root − (W + 2).
      windows = jnp.asarray([c.layer_windows[i] + 2], jnp.int32) if sliding else None
      layer = DecoderLayer(c, False, sliding=sliding, kv_shared=True, name=f"layers_{i}")
      (x, _, _), _ = layer(
        (x, None, jnp.int32(0)), cos, sin, end, nothing, positions, windows, None, None,
        sources[sliding],
      )
    x = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype, name="norm")(x)
    nxt = Dense((a.backbone_hidden_size,), ("embed", "mlp"), name="post_projection", **dense)(x)
    table = self.param(
      "embed",
      nn.with_logical_partitioning(normal_init(), ("vocab", "embed")),
      (c.vocab_size, c.hidden_size),
      dtype_of(c.param_dtype),
    )
    if a.ordered_head:
      centroids = self.param(
        "centroids",
        nn.with_logical_partitioning(normal_init(), ("embed", "vocab")),
        (c.hidden_size, a.num_centroids),
        dtype_of(c.param_dtype),
      )
      ordering = self.param(
        "token_ordering", lambda key, shape: jnp.arange(shape[0], dtype=jnp.int32), (c.vocab_size,)
      )
      dt = dtype_of(c.dtype)
      logits = ordered_logits(x, centroids, ordering, table.astype(dt), a.centroid_top_k)
    else:
      dt = dtype_of(c.dtype)
      logits = jnp.einsum(
        "bth,vh->btv", x.astype(dt), table.astype(dt), preferred_element_type=jnp.float32
      )
    return logits.astype(jnp.float32), nxt


@flax.struct.dataclass
class AssistantState:
  last_hidden: jax.Array  # [B, Hb] target final-normed hidden at slot seq_len - 2

  AXES: ClassVar[dict] = {"last_hidden": ("batch", "embed")}


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantDrafter(Drafter):
  """Drafts γ tokens per step with a Gemma 4 assistant over the target's decoding state.

  params: {"assistant": AssistantModel parameters, "embed": the target's embedding table}.
  sample_drafts: at T > 0 draw each draft from the warped q (chain verification); False
  drafts the argmax (q one-hot), as tree verification does.
  """

  config: AssistantConfig = None  # type: ignore[assignment]
  target: ModelConfig = None  # type: ignore[assignment]
  gamma: int = 4
  sample_drafts: bool = True
  prefill_reads_hidden: ClassVar[bool] = True

  def __post_init__(self):
    if self.config is None or self.target is None:
      raise ConfigError("Gemma4AssistantDrafter needs the assistant's and the target's configs")
    check_gamma("Gemma4AssistantDrafter", self.gamma)
    check_pair(self.config, self.target)

  @classmethod
  def for_target(
    cls, target: TargetModel, config: AssistantConfig, params: Any, **kwargs: Any
  ) -> "Gemma4AssistantDrafter":
    """Binds assistant parameters to `target` (its embedding is shared, not copied)."""
    return cls(
      params={"assistant": params, "embed": target.params["embed"]},
      config=config,
      target=target.config,
      **kwargs,
    )

  @property
  def vocab_size(self) -> int:
    return self.target.vocab_size

  def for_tree(self, sampled_chain: bool = False) -> "Gemma4AssistantDrafter":
    return dataclasses.replace(self, sample_drafts=sampled_chain)

  def init_state(self, params: Any, batch: int, max_len: int) -> AssistantState:
    del params, max_len
    width = self.target.hidden_size
    return AssistantState(jnp.zeros((batch, width), jnp.dtype(self.target.dtype)))

  def prefill(self, params: Any, state: AssistantState, ctx: PrefillContext) -> AssistantState:
    del params
    return AssistantState(ctx.at_last(ctx.hidden, state.last_hidden))

  def _embed(self, table: jax.Array, tokens: jax.Array) -> jax.Array:
    """The target's (scaled) embedding of tokens [B] → [B, 1, Hb]."""
    h = scaled_rows(table, tokens, self.target.embedding_scale)
    return h.astype(jnp.dtype(self.target.dtype))[:, None]

  def kv_end(self, slot: jax.Array) -> jax.Array:
    """The first slot of the target's state the assistant does not read: the root's own (its
    K/V are not computed until the next verify pass)."""
    return slot

  def sources(self, target_state: Any, batch: int) -> dict:
    """Layer type → what the assistant's layers of that type attend to (`shared_sources`)."""
    if target_state is None:
      raise ValueError("the Gemma 4 assistant reads the target's decoding state: none given")
    return shared_sources(self.target, target_state, batch)

  def propose(
    self, params: Any, state: AssistantState, ctx: ProposeContext
  ) -> tuple[Proposal, AssistantState]:
    b = ctx.tokens.shape[0]
    rows = jnp.arange(b)
    slot = ctx.seq_len - 1  # the root's: the target state holds every position before it
    root = ctx.tokens[rows, slot]
    sources = self.sources(ctx.target_state, b)
    positions = slot[:, None].astype(jnp.int32)
    end = self.kv_end(slot).astype(jnp.int32)
    model = AssistantModel(self.config)
    keys = sampling.split_key(ctx.key, self.gamma)

    def step(carry, key):
      tok, hidden = carry
      logits, nxt = model.apply(
        {"params": params["assistant"]},
        self._embed(params["embed"], tok),
        hidden[:, None],
        sources,
        positions,
        end,
      )
      logits = logits[:, 0]
      draft, q = feature_chain.draw(key, logits, ctx.sampling, self.sample_drafts)
      lp = feature_chain.tree_logprobs(logits, ctx.sampling)
      draft = draft.astype(jnp.int32)
      out = (draft, lp) + ((q,) if q is not None else ())
      return (draft, nxt[:, 0].astype(hidden.dtype)), out

    _, outs = jax.lax.scan(step, (root, state.last_hidden), keys)
    tokens = jnp.moveaxis(outs[0], 0, 1)
    logprobs = jnp.moveaxis(outs[1], 0, 1)
    probs = jnp.moveaxis(outs[2], 0, 1) if self.sample_drafts else None
    return Proposal(tokens, probs, logprobs), state

  def commit(self, params: Any, state: AssistantState, ctx: CommitContext) -> AssistantState:
    del params
    b = ctx.hidden.shape[0]
    count = ctx.seq_len - ctx.old_seq_len  # the new root sits at block slot `count`
    kept = ctx.hidden[jnp.arange(b), jnp.maximum(count - 1, 0)].astype(state.last_hidden.dtype)
    return AssistantState(jnp.where((count > 0)[:, None], kept, state.last_hidden))


def check_pair(config: AssistantConfig, target: ModelConfig) -> None:
  """ConfigError unless the assistant can read `target`: a Gemma 4 target of its vocabulary
  and width whose K/V-computing layers of each of the assistant's layer types have the
  assistant's head widths and KV heads."""
  a = config.text
  if target.architecture != a.architecture:
    raise ConfigError(
      f"{ARCHITECTURE} drafts for {a.architecture} targets, not {target.architecture}"
    )
  if a.vocab_size != target.vocab_size:
    raise InputError(
      f"assistant vocabulary ({a.vocab_size}) differs from the target's ({target.vocab_size})"
    )
  if config.backbone_hidden_size != target.hidden_size:
    raise ConfigError(
      f"assistant backbone_hidden_size ({config.backbone_hidden_size}) differs from the "
      f"target's hidden_size ({target.hidden_size})"
    )
  stores = kv_stores(target)
  for sliding in sorted({a.is_sliding(i) for i in range(a.num_layers)}):
    kind = "sliding" if sliding else "full"
    if sliding not in stores:
      raise ConfigError(f"the assistant has {kind} layers; the target has no {kind} K/V")
    want = (a.attention_head_dim(sliding), a.attention_kv_heads(sliding))
    got = (target.attention_head_dim(sliding), target.attention_kv_heads(sliding))
    if want != got:
      raise ConfigError(
        f"the assistant's {kind} layers read (head width, KV heads) {want}; the target "
        f"stores {got}"
      )


# -- checkpoints ----------------------------------------------------------------------------------


def assistant_config_from_hf(hf: dict, source: str = "config.json") -> AssistantConfig:
  """The AssistantConfig of a `Gemma4AssistantForCausalLM` config.json dict."""
  r = HFConfigReader(hf, ARCHITECTURE)
  text = r.mapping("text_config")
  if not text:
    raise ConfigError(f"{source}: {ARCHITECTURE} config.json has no text_config object")
  n = text.get("num_hidden_layers")
  shared = text.get("num_kv_shared_layers", n)
  if shared not in (None, n):
    raise ConfigError(f"{source}: every assistant layer must be KV-shared ({shared} of {n})")
  if text.get("enable_moe_block") or text.get("use_double_wide_mlp"):
    raise ConfigError(f"{source}: the assistant's MoE block or double-wide MLP is not supported")
  layers = {**text, "architectures": ["Gemma4ForCausalLM"], "num_kv_shared_layers": 0}
  layers.setdefault("hidden_size_per_layer_input", 0)
  layers.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
  try:
    text_config = text_config_from_hf(layers)
  except ConfigError as e:
    raise ConfigError(f"{source}: text_config: {e}") from None
  if not text_config.tie_word_embeddings:
    raise ConfigError(f"{source}: the assistant's head is its tied embedding table")
  return AssistantConfig(
    text=text_config,
    backbone_hidden_size=r.integer("backbone_hidden_size", 1536),
    ordered_head=r.flag("use_ordered_embeddings", False),
    num_centroids=r.integer("num_centroids", 2048),
    centroid_top_k=r.integer("centroid_intermediate_top_k", 32),
  )


def _entries(config: AssistantConfig) -> list[drafter_ckpt.Entry]:
  """(HF name, parameter path, kind) of every assistant tensor."""
  c = config.text
  e = [
    ("model.embed_tokens.weight", ("embed",), "same"),
    ("model.norm.weight", ("norm", "scale"), "same"),
    ("pre_projection.weight", ("pre_projection", "kernel"), "linear"),
    ("post_projection.weight", ("post_projection", "kernel"), "linear"),
  ]
  if config.ordered_head:
    e.append(("masked_embedding.centroids.weight", ("centroids",), "linear"))
  for i in range(c.num_layers):
    layer = tensor_map.layer_entries(c, False, sliding=c.is_sliding(i), kv_shared=True)
    for name, path, kind in layer:
      e.append((f"model.layers.{i}.{name}", (f"layers_{i}", *path), kind))
  return e


ORDERING = "masked_embedding.token_ordering"


def param_shapes(config: AssistantConfig, target: ModelConfig) -> Any:
  """The assistant's parameter shapes (jax.ShapeDtypeStruct tree)."""
  b = 1
  hb = config.backbone_hidden_size
  dt = jnp.dtype(target.dtype)
  sources = shared_sources(target, None, b)
  init = lambda key: AssistantModel(config).init(
    key,
    jnp.zeros((b, 1, hb), dt),
    jnp.zeros((b, 1, hb), dt),
    sources,
    jnp.zeros((b, 1), jnp.int32),
    jnp.zeros((b,), jnp.int32),
  )
  return nn.meta.unbox(jax.eval_shape(init, jax.random.PRNGKey(0))["params"])


def load_assistant(
  model_dir: str, target: TargetModel, gamma: Optional[int] = None, **kwargs: Any
) -> Gemma4AssistantDrafter:
  """A published Gemma 4 assistant checkpoint bound to `target` (checked against it)."""
  hf = hf_io.read_config(model_dir)
  config = assistant_config_from_hf(hf, os.path.join(model_dir, "config.json"))
  check_pair(config, target.config)
  entries = _entries(config)
  extra = (ORDERING,) if config.ordered_head else ()
  # (a tied lm_head.weight, saved beside the table, is read by nothing)
  params, raw, dtype = drafter_ckpt.read_checkpoint(
    model_dir, entries, param_shapes(config, target.config), extra=extra + ("lm_head.weight",)
  )
  if config.ordered_head:
    if ORDERING not in raw:
      raise hf_io.CheckpointError(f"checkpoint in {model_dir} lacks {ORDERING}")
    ordering = np.asarray(raw[ORDERING]).astype(np.int64)
    v = config.text.vocab_size
    if ordering.shape != (v,) or not np.array_equal(np.sort(ordering), np.arange(v)):
      raise hf_io.CheckpointError(
        f"{ORDERING} in {model_dir} must be a permutation of the {v} token ids"
      )
    params["token_ordering"] = ordering.astype(np.int32)
  config = dataclasses.replace(config, text=config.text.with_options(param_dtype=dtype))
  params = jax.tree_util.tree_map(jnp.asarray, params)
  options = {"gamma": gamma} if gamma is not None else {}
  return Gemma4AssistantDrafter.for_target(target, config, params, **options, **kwargs)
