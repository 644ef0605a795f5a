"""The decoder: embed → scanned layer stacks → final norm → LM head; plus MTP layers.

One forward serves prefill, decode and verification: a block of T new tokens per sequence is
written into the decoding state (jaxspec/state/) at per-sequence slots `start[b]`, each token
attends to the committed prefix (slots < start) and, inside the block, to what `block_mask`
allows (causal by default; an ancestor mask for tree verification). RoPE positions default to
start + t but can be given explicitly (tree nodes sit at start + depth). Without a state
(training, full-sequence logits) the block attends to itself only.

Layers are stacked with `nn.scan`, one scan per maximal run of same-kind layers (a dense first
layer and MoE layers after it make two runs), so compile time does not grow with depth; with
`config.options.scan_layers=False` each run is unrolled over per-layer parameters instead
(`LayerRun`, decoding's layout). Each run carries its own state entry whole and updates it in
place at the block's slots.

Hidden states (batch, length, embed) and logits (batch, length, vocab) carry logical constraints
(`sharding.constrain_activation`), no-ops unless a mesh is active (`sharding.use_mesh`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.models import attention as attention_lib
from jaxspec.models.gated_deltanet import GatedDeltaNet
from jaxspec.models.mla import MLAttention
from jaxspec.models.layers import (
  MLP,
  Attention,
  Dense,
  RMSNorm,
  activation,
  dtype_of,
  normal_init,
  rope_tables,
  scaled_rows,
  unfused_logits,
)
from jaxspec.models.moe import MoE
from jaxspec.state import NO_LIMIT, DecodingState


class DecoderOutput(NamedTuple):
  """What a forward returns.

  logits: [B, T, V] float32 (or [B, 1, V] with `last_only` or `logits_index`).
  state: the decoding state with the block written (lengths unchanged), or None.
  taps: [n_taps, B, T, H] HF hidden_states[i + 1] of the tapped layers i, or None: layer i's
    output, and for the last layer the final-normed state (HF normalises its last entry).
  hidden: [B, T, H] final-normed output of the last layer (the LM head's input; what HF
    reports as hidden_states[-1] and what MTP layers consume).
  """

  logits: jax.Array
  state: DecodingState | None
  taps: jax.Array | None
  hidden: jax.Array


class DecoderLayer(nn.Module):
  """Pre-norm block: x + mix(norm(x)); x + ffn(norm(x)). The token mixer is attention (MLA in
  MLA targets, models/mla.py) or, with `linear`, a Gated DeltaNet (models/gated_deltanet.py);
  the FFN is dense or MoE.

  Gemma's features (`config.family`): sandwich norms (each sublayer's output normed too), the
  layer's output scaled by a learned `layer_scalar` (Gemma 4), the MoE block beside the MLP
  where `moe`, and Gemma 4's per-layer input (`per_layer` [B, T, P]) added through a gated projection. In targets with
  KV-shared layers the carry holds the block K/V of the run's last layer (`extra`), which the
  shared layers of its type read (`shared`), and `kv_shared` layers compute no K/V."""

  config: ModelConfig
  moe: bool
  linear: bool = False
  indexer: bool = False  # DSA: runs its own lightning indexer (else reuses the carried choice)
  sliding: bool = False  # a sliding-window attention layer (MiMo's, Gemma 4's differ in shape)
  kv_shared: bool = False  # Gemma 4: attends to its source layer's K/V (`shared`)

  @nn.compact
  def __call__(
    self,
    carry: tuple,
    cos: jax.Array,
    sin: jax.Array,
    start: jax.Array,
    block_mask: jax.Array | None,
    positions: jax.Array | None = None,
    windows: jax.Array | None = None,
    valid: jax.Array | None = None,
    per_layer: jax.Array | None = None,
    shared: attention_lib.SharedSource | None = None,
  ):
    # (h, kv, layer), and in DSA targets the last indexer's choice (attention.Selection), in
    # targets with KV-shared layers the run's last block K/V.
    h, kv, layer, *extra = carry
    c = self.config
    norm = lambda name: RMSNorm(
      c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype, c.norm_offset, name=name
    )
    if self.linear:
      attn_out, kv = GatedDeltaNet(c, name="linear_attn")(
        norm("input_layernorm")(h), kv, layer, start, valid, block_mask
      )
    elif c.is_mla:
      attn_out, kv, chosen = MLAttention(c, self.indexer, name="self_attn")(
        norm("input_layernorm")(h), kv, layer, start, cos, sin, block_mask, *extra
      )
      if extra:
        extra = [chosen]
    else:
      window = None if windows is None else attention_lib.Window(windows[layer], positions)
      attention = Attention(c, self.sliding, self.kv_shared, name="self_attn")
      attn_out, kv, source = attention(
        norm("input_layernorm")(h), kv, layer, start, cos, sin, block_mask, window, shared
      )
      if extra and source is not None:  # the block K/V this run's last layer leaves
        extra = [source.k.astype(extra[0].dtype), source.v.astype(extra[1].dtype)]
    sandwich = c.family.sandwich_norms
    if sandwich:
      h = h + norm("post_attention_layernorm")(attn_out)
      x = norm("pre_feedforward_layernorm")(h)
    else:
      h = h + attn_out
      x = norm("post_attention_layernorm")(h)
    width = c.intermediate_size * (2 if c.use_double_wide_mlp and self.kv_shared else 1)
    if c.family.moe_beside_mlp:
      ffn = MLP(c, width, name="mlp")(x)
      if self.moe:  # the MoE block beside the MLP: routed on the residual, its own norms
        experts = MoE(c, name="moe")(norm("pre_feedforward_layernorm_2")(h), router_input=h)
        ffn = norm("post_feedforward_layernorm_1")(ffn) + norm("post_feedforward_layernorm_2")(
          experts
        )
    else:
      ffn = (MoE(c, name="mlp") if self.moe else MLP(c, width, name="mlp"))(x)
    h = h + (norm("post_feedforward_layernorm")(ffn) if sandwich else ffn)
    if c.hidden_size_per_layer_input:
      h = h + self._per_layer_input(h, per_layer, norm)
    if c.family.layer_scalar:
      scalar = self.param(
        "layer_scalar", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (1,),
        dtype_of(c.param_dtype),
      )
      h = (h * scalar.astype(h.dtype)).astype(h.dtype)
    h = sharding.constrain_activation(h, "embed")
    return (h, kv, layer + 1, *extra), h

  @nn.nowrap
  def _per_layer_input(self, h: jax.Array, per_layer: jax.Array, norm) -> jax.Array:
    """Gemma 4's per-layer input: norm(proj(act(gate(h)) · per_layer))."""
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    width = c.hidden_size_per_layer_input
    gate = Dense((width,), ("embed", "mlp"), name="per_layer_input_gate", **dense)(h)
    x = activation(c.hidden_act)(gate) * per_layer.astype(gate.dtype)
    x = Dense((c.hidden_size,), ("mlp", "embed"), name="per_layer_projection", **dense)(x)
    return norm("post_per_layer_input_norm")(x)


class LayerRun(nn.Module):
  """A run of same-kind layers unrolled over per-layer parameters ("0", "1", … subtrees).

  The same interface as the scanned run: ((h, kv, layer), per-layer outputs [n, B, T, H]).
  Each matmul reads its layer's weights where they are; a scanned run slices them out of the
  stack first, which costs a copy of every weight per step where the backend cannot feed a
  matmul from a dynamic slice (XLA:CPU). Compile time grows with depth.
  """

  config: ModelConfig
  moe: bool
  length: int
  linear: bool = False
  indexer: bool = False
  sliding: bool = False
  kv_shared: bool = False

  @nn.compact
  def __call__(
    self,
    carry: tuple,
    cos,
    sin,
    start,
    block_mask,
    positions=None,
    windows=None,
    valid=None,
    per_layer=None,
    shared=None,
  ):
    outs = []
    for j in range(self.length):
      layer = DecoderLayer(
        self.config,
        self.moe,
        self.linear,
        self.indexer,
        self.sliding,
        self.kv_shared,
        name=str(j),
      )
      carry, h = layer(
        carry,
        cos,
        sin,
        start,
        block_mask,
        positions,
        windows,
        valid,
        None if per_layer is None else per_layer[j],
        shared,
      )
      outs.append(h)
    return carry, jnp.stack(outs)


def stack_layer_params(config: ModelConfig, params: Any) -> Any:
  """Per-layer parameters (`scan_layers=False` layout) → stacked [n, ...] (the scanned one).

  numpy leaves stay numpy (host), device leaves are stacked on their device.
  """
  out = dict(params)
  for i, (_, n, _) in enumerate(config.segments()):
    run = params[f"layers_{i}"]
    out[f"layers_{i}"] = jax.tree_util.tree_map(
      lambda *xs: (np.stack if isinstance(xs[0], np.ndarray) else jnp.stack)(xs),
      *[run[str(j)] for j in range(n)],
    )
  return out


def unstack_layer_params(config: ModelConfig, params: Any) -> Any:
  """Stacked [n, ...] layer parameters → one subtree per layer, each leaf its own buffer.

  Host (numpy) leaves are sliced as views and stay host arrays; device leaves are split once.
  """
  out = dict(params)
  for i, (_, n, _) in enumerate(config.segments()):
    run = params[f"layers_{i}"]
    out[f"layers_{i}"] = {
      str(j): jax.tree_util.tree_map(lambda x, j=j: x[j], run) for j in range(n)
    }
  return out


def no_selection(config: ModelConfig, batch: int, t: int, kv: Any) -> list:
  """The DSA choice carried into a target's first layer (which runs its own indexer, so it is
  never read), shaped as the indexer's so a layer scan's carry keeps one structure: [] for
  targets without DSA, else [Selection] over the state's slots (None without a state)."""
  if not config.is_dsa:
    return []
  cache = None if kv is None else jnp.zeros((batch, t, kv.max_len), bool)
  return [attention_lib.Selection(cache, jnp.zeros((batch, t, t), bool))]


def write_limit(start: jax.Array, valid: jax.Array | None) -> jax.Array:
  """[B]: the first position of a block a ring entry may not store: past each padded prompt's
  end (`valid` tokens of the block are real), or none."""
  if valid is None:
    return jnp.full(start.shape, NO_LIMIT, jnp.int32)
  return (start + valid).astype(jnp.int32)


FULL_WINDOW = 2**30  # a window no context reaches: full attention in a layer scan with windows


def layer_windows(config: ModelConfig, first: int, n: int) -> jax.Array | None:
  """int32 [n]: the sliding window of layers first..first+n-1 (FULL_WINDOW for full-attention
  layers), or None when none of them slides (then no window mask is built at all)."""
  windows = config.layer_windows[first : first + n]
  if not any(windows):
    return None
  return jnp.asarray([w or FULL_WINDOW for w in windows], jnp.int32)


def _stack(
  config: ModelConfig,
  moe: bool,
  length: int,
  name: str,
  linear: bool,
  indexer: bool = False,
  sliding: bool = False,
  kv_shared: bool = False,
) -> nn.Module:
  if not config.options.scan_layers:
    return LayerRun(config, moe, length, linear, indexer, sliding, kv_shared, name=name)
  scanned = nn.scan(
    DecoderLayer,
    variable_axes={"params": 0, "intermediates": 0},
    split_rngs={"params": True},
    # per-layer inputs are scanned over; everything else is the same for every layer
    in_axes=(nn.broadcast,) * 7 + (0, nn.broadcast),
    length=length,
    metadata_params={nn.PARTITION_NAME: "layers"},
  )
  return scanned(config, moe, linear, indexer, sliding, kv_shared, name=name)


class MTPLayer(nn.Module):
  """A multi-token-prediction module (DeepSeek-V3 / GLM, and Qwen3.5 / Qwen3-Next's `mtp.*`).

  h' = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) → a full-attention decoder block →
  post_norm; the shared LM head turns it into logits for token i+2. The embedding and head are
  the main model's unless the config gives the layer its own (`mtp_own_embed` / `mtp_own_head`:
  a published checkpoint whose MTP copies differ from the main tensors). Hybrid targets name the
  pieces fc, pre_fc_norm_embedding, pre_fc_norm_hidden and norm, use zero-centred norms, and
  feed the *normed* output to the next draft (see `Decoder.mtp_forward`).
  """

  config: ModelConfig

  def setup(self):
    c = self.config
    norm = lambda: RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype, c.norm_offset)
    self.enorm = norm()
    self.hnorm = norm()
    self.eh_proj = Dense(
      (c.hidden_size,), ("mlp", "embed"), dtype=c.dtype, param_dtype=c.param_dtype
    )
    # Full attention, also in hybrid targets; in DSA targets with its own indexer.
    self.block = DecoderLayer(c, c.mtp_is_moe, indexer=c.is_dsa, sliding=c.mtp_sliding)
    self.post_norm = norm()
    # The layer's own embedding / LM head, when its published copy differs from the main one.
    if c.mtp_own_embed:
      self.embed = self.param(
        "embed",
        nn.with_logical_partitioning(normal_init(), ("vocab", "embed")),
        (c.vocab_size, c.hidden_size),
        dtype_of(c.param_dtype),
      )
    if c.mtp_own_head:
      self.head = Dense(
        (c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, param_dtype=c.param_dtype
      )

  def own_embedding(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings from the layer's own table (`config.mtp_own_embed`)."""
    c = self.config
    h = scaled_rows(self.embed, tokens, c.embedding_scale)
    return sharding.constrain_activation(h.astype(dtype_of(c.dtype)), "embed")

  def own_logits(self, h: jax.Array) -> jax.Array:
    """Logits before capping from the layer's own LM head (`config.mtp_own_head`)."""
    return self.head(h).astype(jnp.float32)

  def __call__(
    self,
    emb: jax.Array,
    prev_hidden: jax.Array,
    kv: Any,
    cos: jax.Array,
    sin: jax.Array,
    start: jax.Array,
    block_mask: jax.Array | None,
    positions: jax.Array | None = None,
  ):
    c = self.config
    x = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(prev_hidden)], axis=-1))
    x = sharding.constrain_activation(x, "embed")
    carry = (x, kv, jnp.int32(0), *no_selection(c, x.shape[0], x.shape[1], kv))
    windows = None  # MiMo: the sliding layers' window
    if c.mtp_sliding and c.sliding_window:
      windows = jnp.asarray([c.sliding_window], jnp.int32)
    (h, kv, *_), _ = self.block(carry, cos, sin, start, block_mask, positions, windows)
    return h, self.post_norm(h), kv


class Decoder(nn.Module):
  """The target model. Parameters: embed, layers_{i} (scanned runs), norm, lm_head, mtp_{k}."""

  config: ModelConfig

  def setup(self):
    c = self.config
    self.embed = self.param(
      "embed",
      nn.with_logical_partitioning(normal_init(), ("vocab", "embed")),
      (c.vocab_size, c.hidden_size),
      dtype_of(c.param_dtype),
    )
    self.stacks = [
      _stack(
        c,
        moe,
        n,
        f"layers_{i}",
        c.is_linear(first),
        c.is_dsa and c.is_full_indexer(first),
        c.is_sliding(first),
        c.is_kv_shared(first),
      )
      for i, (first, n, moe) in enumerate(c.segments())
    ]
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype, c.norm_offset)
    if c.hidden_size_per_layer_input:  # Gemma 4's per-layer inputs
      width = c.num_layers * c.hidden_size_per_layer_input
      self.embed_per_layer = self.param(
        "embed_per_layer",
        nn.with_logical_partitioning(normal_init(), ("vocab", "mlp")),
        (c.vocab_size_per_layer_input, width),
        dtype_of(c.param_dtype),
      )
      self.per_layer_model_projection = Dense(
        (width,), ("embed", "mlp"), dtype=c.dtype, param_dtype=c.param_dtype
      )
      self.per_layer_projection_norm = RMSNorm(
        c.hidden_size_per_layer_input, c.rms_norm_eps, "mlp", c.param_dtype
      )
    if not c.tie_word_embeddings:
      self.lm_head = Dense(
        (c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, param_dtype=c.param_dtype
      )
    self.mtp = [MTPLayer(c, name=f"mtp_{k}") for k in range(c.num_mtp_layers)]

  # -- pieces shared by the main stack and the MTP layers ------------------------------------------

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    """Token embeddings [B, T, H] (Gemma 4 scales them by sqrt(hidden_size), in the weights'
    dtype as transformers does)."""
    c = self.config
    h = scaled_rows(self.embed, tokens, c.embedding_scale)
    return sharding.constrain_activation(h.astype(dtype_of(c.dtype)), "embed")

  def per_layer_inputs(self, tokens: jax.Array, h: jax.Array) -> jax.Array | None:
    """Gemma 4's per-layer inputs [L, B, T, P]: (norm(proj(embedding) / sqrt(H)) + the
    token's per-layer embedding · sqrt(P)) / sqrt(2); None for other models."""
    c = self.config
    width = c.hidden_size_per_layer_input
    if not width:
      return None
    b, t = tokens.shape
    dt = dtype_of(c.dtype)
    table = scaled_rows(self.embed_per_layer, tokens, width**0.5).astype(dt)
    proj = self.per_layer_model_projection(h) * jnp.asarray(c.hidden_size**-0.5, dt)
    proj = self.per_layer_projection_norm(proj.reshape(b, t, c.num_layers, width))
    out = (proj + table.reshape(b, t, c.num_layers, width)) * jnp.asarray(2.0**-0.5, dt)
    return jnp.moveaxis(out.astype(dt), 2, 0)

  def head(self, h: jax.Array, mtp: "MTPLayer | None" = None) -> jax.Array:
    """Final-normed hidden → float32 logits [B, T, V] with the (tied or untied) LM head, split
    over the vocabulary as the head is; with `mtp`, that MTP layer's own head if it has one."""
    c = self.config
    if mtp is not None and c.mtp_own_head:
      logits = mtp.own_logits(h)
    elif c.tie_word_embeddings:
      dt = dtype_of(c.dtype)
      logits = jnp.einsum(
        "bth,vh->btv", h.astype(dt), self.embed.astype(dt), preferred_element_type=jnp.float32
      )
    else:
      logits = self.lm_head(h).astype(jnp.float32)
    if c.final_logit_softcapping:  # Gemma 4: cap · tanh(logits / cap)
      cap = c.final_logit_softcapping
      logits = jnp.tanh(logits / cap) * cap
    return unfused_logits(sharding.constrain_activation(logits, "vocab"))

  def _rope(self, positions: jax.Array, theta: float | None = None):
    """cos/sin tables at `positions` with RoPE base `theta` (default: the config's)."""
    c = self.config
    theta = c.rope_theta if theta is None else theta
    return rope_tables(positions, c.rotary_dim, theta, c.rope_scaling)

  def rope_for(self, layer: int, positions: jax.Array, tables: dict) -> tuple:
    """Layer `layer`'s cos/sin at `positions`, made once per RoPE setting in `tables`."""
    spec = self.config.layer_rope(layer)
    if spec not in tables:
      tables[spec] = rope_tables(positions, *spec)
    return tables[spec]

  # -- forwards ------------------------------------------------------------------------------------

  def __call__(
    self,
    tokens: jax.Array,
    start: jax.Array | None = None,
    state: DecodingState | None = None,
    positions: jax.Array | None = None,
    block_mask: jax.Array | None = None,
    taps: tuple[int, ...] = (),
    last_only: bool = False,
    logits_index: jax.Array | None = None,
    valid: jax.Array | None = None,
  ) -> DecoderOutput:
    """Runs a block of T tokens per sequence; see the module docstring.

    `valid` [B] (optional) says how many of the block's tokens belong to each sequence (padded
    prompts): linear-attention layers then keep the state after that many tokens, and tokens
    past it never enter their recurrent state. Attention layers ignore it (padding K/V sits
    past the committed length, where no query looks).

    Logits are computed for every block position, only the last (`last_only`), or only at
    per-sequence index `logits_index` [B] (e.g. each padded prompt's last token): the LM head
    is the largest matmul of a small model, so prefill should not pay it for every position.
    """
    b, t = tokens.shape
    if start is None:
      start = jnp.zeros((b,), jnp.int32)
    if positions is None:
      positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    c = self.config
    tables: dict = {}  # cos/sin per RoPE setting (MiMo, Gemma 4: one per layer type)
    h = self.embed_tokens(tokens)
    inputs = self.per_layer_inputs(tokens, h)  # Gemma 4: [L, B, T, P]
    per_layer, entries = [], []
    first_kv = None if state is None else state.segments[0]
    select = no_selection(c, b, t, first_kv)  # DSA: the indexer's choice, carried
    sources = {}  # Gemma 4: by layer type, what its KV-shared layers read
    for i, (stack, (first, n, _)) in enumerate(zip(self.stacks, c.segments())):
      kv = None if state is None else state.segments[i]
      if kv is not None:  # a short unpadded block may be accepted in part: keep every prefix
        kv = kv.begin_block(start, t, valid is None and t <= c.options.linear_snapshots)
        kv = kv.with_bounds(limit=write_limit(start, valid))  # rings: no padding written
      cos, sin = self.rope_for(first, positions, tables)
      shared, carried = None, list(select)
      if c.num_kv_shared_layers:
        if c.is_kv_shared(first):
          shared, kv = sources[c.is_sliding(first)], None
        else:  # this run's last block K/V, carried out for the shared layers
          heads, dim = c.layer_kv_heads(first), c.layer_head_dim(first)
          zeros = jnp.zeros((b, t, heads, dim), dtype_of(c.dtype))
          carried = [zeros, jnp.zeros((b, t, heads, c.layer_value_head_dim(first)), zeros.dtype)]
      kv_in = kv
      (h, kv, _, *carried), hs = stack(
        (h, kv, jnp.int32(0), *carried),
        cos,
        sin,
        start,
        block_mask,
        positions,
        layer_windows(c, first, n),
        valid,
        None if inputs is None else inputs[first : first + n],
        shared,
      )
      if shared is not None:
        kv = state.segments[i] if state is not None else None
      elif c.num_kv_shared_layers:
        source = attention_lib.SharedSource(kv_in, kv, jnp.int32(n - 1), *carried)
        sources[c.is_sliding(first)] = source
      else:
        select = carried
      per_layer.append(hs)
      entries.append(kv)
    if state is not None:
      state = state.replace(segments=tuple(entries))
    normed = sharding.constrain_activation(self.norm(h), "embed")
    tapped = None
    if taps:
      # HF hidden_states[i + 1]: layer i's output, except that the last entry is final-normed.
      all_h = jnp.concatenate(per_layer, axis=0) if len(per_layer) > 1 else per_layer[0]
      last = self.config.num_layers - 1
      tapped = jnp.stack([normed if i == last else all_h[i] for i in taps])
    if logits_index is not None:
      picked = jnp.take_along_axis(normed, logits_index[:, None, None], axis=1)
    else:
      picked = normed[:, -1:] if last_only else normed
    logits = self.head(picked)
    return DecoderOutput(logits, state, tapped, normed)

  def mtp_forward(
    self,
    k: int,
    tokens: jax.Array,
    prev_hidden: jax.Array,
    start: jax.Array | None = None,
    state: DecodingState | None = None,
    positions: jax.Array | None = None,
    block_mask: jax.Array | None = None,
  ):
    """MTP layer k over a block: returns (logits, hidden for the next depth, state).

    The hidden for the next depth is the block's output before `post_norm` (DeepSeek-V3, GLM:
    the shared head norms it) or after it (Qwen3.5 / Qwen3-Next, whose MTP module returns its
    normed output and is chained on it, as vLLM and SGLang run it).

    `tokens` are the tokens one step ahead of `prev_hidden` (token i+1 beside hidden i); the
    layer's own state has one segment of one layer (`DecodingState.create(...,
    segment_layers=(1,))`), or None for a cache-free forward (training).
    """
    b, t = tokens.shape
    if start is None:
      start = jnp.zeros((b,), jnp.int32)
    if positions is None:
      positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    c = self.config
    cos, sin = self._rope(positions, (c.sliding_rope_theta or None) if c.mtp_sliding else None)
    kv = None if state is None else state.segments[0]
    layer = self.mtp[k]
    emb = layer.own_embedding(tokens) if c.mtp_own_embed else self.embed_tokens(tokens)
    h, normed, kv = layer(emb, prev_hidden, kv, cos, sin, start, block_mask, positions)
    if state is not None:
      state = state.replace(segments=(kv,))
    return self.head(normed, layer), normed if self.config.is_hybrid else h, state

  def init_all(self, tokens: jax.Array) -> Any:
    """Touches every parameter (main stack and MTP layers) so that `init` creates them all."""
    out = self(tokens)
    for k in range(self.config.num_mtp_layers):
      self.mtp_forward(k, tokens, out.hidden)
    return out.logits
