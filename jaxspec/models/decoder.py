"""The decoder: embed → scanned layer stacks → final norm → LM head; plus MTP layers.

One forward serves prefill, decode and verification: a block of T new tokens per sequence is
written into the decoding state (jaxspec/state/) at per-sequence slots `start[b]`, each token
attends to the committed prefix (slots < start) and, inside the block, to what `block_mask`
allows (causal by default; an ancestor mask for tree verification). RoPE positions default to
start + t but can be given explicitly (tree nodes sit at start + depth). Without a state
(training, full-sequence logits) the block attends to itself only.

Layers are stacked with `nn.scan`, one scan per maximal run of same-kind layers (a dense first
layer and MoE layers after it make two runs), so compile time does not grow with depth; with
`config.scan_layers=False` each run is unrolled over per-layer parameters instead (`LayerRun`,
decoding's layout). Each run carries its own state entry whole and updates it in place at the
block's slots.

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
  dtype_of,
  normal_init,
  rope_tables,
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
  the FFN is dense or MoE."""

  config: ModelConfig
  moe: bool
  linear: bool = False
  indexer: bool = False  # DSA: runs its own lightning indexer (else reuses the carried choice)
  sliding: bool = False  # a sliding-window attention layer (MiMo's differ in shape)

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
  ):
    # (h, kv, layer), and in DSA targets the last indexer's choice (attention.Selection).
    h, kv, layer, *select = carry
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
        norm("input_layernorm")(h), kv, layer, start, cos, sin, block_mask, *select
      )
      if select:
        select = [chosen]
    else:
      window = None if windows is None else attention_lib.Window(windows[layer], positions)
      attn_out, kv = Attention(c, self.sliding, name="self_attn")(
        norm("input_layernorm")(h), kv, layer, start, cos, sin, block_mask, window
      )
    h = h + attn_out
    x = norm("post_attention_layernorm")(h)
    ffn = MoE(c, name="mlp") if self.moe else MLP(c, c.intermediate_size, name="mlp")
    h = sharding.constrain_activation(h + ffn(x), "embed")
    return (h, kv, layer + 1, *select), h


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

  @nn.compact
  def __call__(
    self, carry: tuple, cos, sin, start, block_mask, positions=None, windows=None, valid=None
  ):
    outs = []
    for j in range(self.length):
      layer = DecoderLayer(
        self.config, self.moe, self.linear, self.indexer, self.sliding, name=str(j)
      )
      carry, h = layer(
        carry, cos, sin, start, block_mask, positions, windows, valid
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
) -> nn.Module:
  if not config.options.scan_layers:
    return LayerRun(config, moe, length, linear, indexer, sliding, name=name)
  scanned = nn.scan(
    DecoderLayer,
    variable_axes={"params": 0, "intermediates": 0},
    split_rngs={"params": True},
    in_axes=(nn.broadcast,) * 7,
    length=length,
    metadata_params={nn.PARTITION_NAME: "layers"},
  )
  return scanned(config, moe, linear, indexer, sliding, name=name)


class MTPLayer(nn.Module):
  """A multi-token-prediction module (DeepSeek-V3 / GLM, and Qwen3.5 / Qwen3-Next's `mtp.*`).

  h' = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]) → a full-attention decoder block →
  post_norm; the shared LM head turns it into logits for token i+2. Hybrid targets name the
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
    self.block = DecoderLayer(c, c.mtp_is_moe, indexer=c.is_dsa)
    self.post_norm = norm()

  def __call__(
    self,
    emb: jax.Array,
    prev_hidden: jax.Array,
    kv: Any,
    cos: jax.Array,
    sin: jax.Array,
    start: jax.Array,
    block_mask: jax.Array | None,
  ):
    x = self.eh_proj(jnp.concatenate([self.enorm(emb), self.hnorm(prev_hidden)], axis=-1))
    x = sharding.constrain_activation(x, "embed")
    carry = (x, kv, jnp.int32(0), *no_selection(self.config, x.shape[0], x.shape[1], kv))
    (h, kv, *_), _ = self.block(carry, cos, sin, start, block_mask)
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
      )
      for i, (first, n, moe) in enumerate(c.segments())
    ]
    self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, "embed", c.param_dtype, c.norm_offset)
    if not c.tie_word_embeddings:
      self.lm_head = Dense(
        (c.vocab_size,), ("embed", "vocab"), dtype=c.dtype, param_dtype=c.param_dtype
      )
    self.mtp = [MTPLayer(c, name=f"mtp_{k}") for k in range(c.num_mtp_layers)]

  # -- pieces shared by the main stack and the MTP layers ------------------------------------------

  def embed_tokens(self, tokens: jax.Array) -> jax.Array:
    h = jnp.take(self.embed, tokens, axis=0).astype(dtype_of(self.config.dtype))
    return sharding.constrain_activation(h, "embed")

  def head(self, h: jax.Array) -> jax.Array:
    """Final-normed hidden → float32 logits [B, T, V] with the (tied or untied) LM head, split
    over the vocabulary as the head is."""
    c = self.config
    if c.tie_word_embeddings:
      dt = dtype_of(c.dtype)
      logits = jnp.einsum(
        "bth,vh->btv", h.astype(dt), self.embed.astype(dt), preferred_element_type=jnp.float32
      )
    else:
      logits = self.lm_head(h).astype(jnp.float32)
    return unfused_logits(sharding.constrain_activation(logits, "vocab"))

  def _rope(self, positions: jax.Array, theta: float | None = None):
    """cos/sin tables at `positions` with RoPE base `theta` (default: the config's)."""
    c = self.config
    theta = c.rope_theta if theta is None else theta
    return rope_tables(positions, c.rotary_dim, theta, c.rope_scaling)

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
    tables = {self.config.rope_theta: self._rope(positions)}  # MiMo: a base per layer type
    h = self.embed_tokens(tokens)
    per_layer, entries = [], []
    first_kv = None if state is None else state.segments[0]
    select = no_selection(self.config, b, t, first_kv)  # DSA: the indexer's choice, carried
    for i, (stack, (first, n, _)) in enumerate(zip(self.stacks, self.config.segments())):
      kv = None if state is None else state.segments[i]
      if kv is not None:  # a short unpadded block may be accepted in part: keep every prefix
        kv = kv.begin_block(start, t, valid is None and t <= self.config.options.linear_snapshots)
        kv = kv.with_bounds(limit=write_limit(start, valid))  # rings: no padding written
      theta = self.config.layer_rope_theta(first)
      if theta not in tables:
        tables[theta] = self._rope(positions, theta)
      cos, sin = tables[theta]
      (h, kv, _, *select), hs = stack(
        (h, kv, jnp.int32(0), *select),
        cos,
        sin,
        start,
        block_mask,
        positions,
        layer_windows(self.config, first, n),
        valid,
      )
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
    cos, sin = self._rope(positions)
    kv = None if state is None else state.segments[0]
    h, normed, kv = self.mtp[k](
      self.embed_tokens(tokens), prev_hidden, kv, cos, sin, start, block_mask
    )
    if state is not None:
      state = state.replace(segments=(kv,))
    return self.head(normed), normed if self.config.is_hybrid else h, state

  def init_all(self, tokens: jax.Array) -> Any:
    """Touches every parameter (main stack and MTP layers) so that `init` creates them all."""
    out = self(tokens)
    for k in range(self.config.num_mtp_layers):
      self.mtp_forward(k, tokens, out.hidden)
    return out.logits
