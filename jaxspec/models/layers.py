"""Transformer building blocks: RMSNorm, RoPE, dense projections, the attention block, SwiGLU MLP.

Every parameter carries logical axis names (see jaxspec/sharding.py), and so do the activations
that cross the mesh (`sharding.constrain_activation`: q/k/v, attention and MLP outputs); no module
names a mesh axis. Norms, softmax and RoPE are computed in float32 whatever the activation dtype.
"""

from __future__ import annotations

import math

from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.models import attention as attention_lib
from jaxspec.models import matmul
from jaxspec.errors import ConfigError
from jaxspec.quant.formats import QTensor


@jax.custom_jvp
def unfused_logits(logits: jax.Array) -> jax.Array:
  """Marks LM-head logits as a fusion boundary (forward only).

  XLA:CPU fuses a consumer reduction (argmax, max, softmax) into the vocabulary matmul and then
  runs the dot as a naive loop: measured 2× slower for a 16 × 128 × 8192 head plus argmax. The
  barrier keeps the dot a library GEMM; on GPU/TPU the dot is never fused with its reduction
  anyway, so nothing is lost there. Tangents and cotangents pass through untouched: a barrier
  on the cotangents of EAGLE-3's unrolled heads made XLA:CPU copy them quadratically (5×
  slower training steps).
  """
  return jax.lax.optimization_barrier(logits)


@unfused_logits.defjvp
def _unfused_logits_jvp(primals, tangents):
  return unfused_logits(primals[0]), tangents[0]


def dtype_of(name: str) -> jnp.dtype:
  return jnp.dtype(name)


def weight(module: nn.Module, name: str, init: Any, shape: tuple, dtype: Any) -> Any:
  """`module.param(name, init, shape, dtype)`, or the quantized weight (jaxspec.quant.QTensor)
  the parameter tree holds there, whose stored arrays have other shapes than the weight."""
  if module.has_variable("params", name):
    value = module.get_variable("params", name)
    if isinstance(value, QTensor):
      if value.shape != tuple(shape):
        raise ConfigError(
          f"quantized {name} in {'/'.join(module.scope.path)} holds a {value.shape} weight, "
          f"the model expects {tuple(shape)}"
        )
      return value
  return module.param(name, init, shape, dtype)


def scaled_rows(table: jax.Array, tokens: jax.Array, scale: float = 1.0) -> jax.Array:
  """Embedding rows of `tokens`, times `scale` in the table's dtype (transformers' scaled
  embeddings: Gemma's sqrt(hidden_size))."""
  rows = jnp.take(table, tokens, axis=0)
  return rows if scale == 1.0 else rows * jnp.asarray(scale, rows.dtype)


def normal_init(stddev: float = 0.02):
  return nn.initializers.normal(stddev)


def _scaled_rms(
  module: nn.Module, x: jax.Array, shape: tuple, axes: tuple, eps: float, param_dtype: str,
  offset: float,
) -> jax.Array:
  """(offset + w) · x / sqrt(mean(x²) + eps) over x's last len(shape) axes, in float32, with
  `module`'s "scale" parameter w of `shape` and logical `axes` (RMSNorm, HeadsRMSNorm)."""
  init = nn.initializers.zeros if offset else nn.initializers.ones
  w = module.param(
    "scale", nn.with_logical_partitioning(init, tuple(axes)), tuple(shape), dtype_of(param_dtype)
  )
  xf = x.astype(jnp.float32)
  reduce = tuple(range(-len(shape), 0))
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=reduce, keepdims=True) + eps)
  return ((w.astype(jnp.float32) + offset) * xf).astype(x.dtype)


class RMSNorm(nn.Module):
  """y = (offset + w) · x / sqrt(mean(x²) + eps), computed in float32 (HF Qwen3/GLM semantics
  with offset 0; Qwen3-Next / Qwen3.5's zero-centred norm, weights stored as w, with offset 1)."""

  dim: int
  eps: float
  axis_name: str = "embed"
  param_dtype: str = "float32"
  offset: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    shape, axes = (self.dim,), (self.axis_name,)
    return _scaled_rms(self, x, shape, axes, self.eps, self.param_dtype, self.offset)


class HeadsRMSNorm(nn.Module):
  """RMSNorm over the last two axes [heads, head_dim] together, one weight per feature.

  MiniMax-M2 normalises the whole q (k) projection, num_heads × head_dim wide, before it is
  split into heads; keeping the weight as [heads, head_dim] lets it shard with the heads.
  """

  shape: tuple[int, int]
  axes: tuple[str, str]
  eps: float
  param_dtype: str = "float32"
  offset: float = 0.0

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    return _scaled_rms(self, x, self.shape, self.axes, self.eps, self.param_dtype, self.offset)


class Dense(nn.Module):
  """x @ W (+ b) with W of shape [in, *out_shape] and logical axes (in_axis, *out_axes).

  W may be a quantized weight (jaxspec.quant); the product is `matmul.dense`'s (a kernel that
  reads the stored bytes on CPU decode and verify blocks, XLA otherwise)."""

  out_shape: Sequence[int]
  axes: Sequence[str]
  use_bias: bool = False
  dtype: str = "float32"
  param_dtype: str = "float32"
  in_dims: int = 1  # contract the last `in_dims` axes of x

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    in_shape = x.shape[-self.in_dims :]
    kernel = weight(
      self,
      "kernel",
      nn.with_logical_partitioning(normal_init(), tuple(self.axes)),
      (*in_shape, *self.out_shape),
      dtype_of(self.param_dtype),
    )
    dt = dtype_of(self.dtype)
    n = self.in_dims
    y = matmul.dense(x, kernel, n, dt)
    if self.use_bias:
      bias = self.param(
        "bias",
        nn.with_logical_partitioning(nn.initializers.zeros, tuple(self.axes[n:])),
        tuple(self.out_shape),
        dtype_of(self.param_dtype),
      )
      y = y + bias.astype(y.dtype)
    return y.astype(dt)


# --------------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------------


def rope_frequencies(rotary_dim: int, theta: float, scaling: tuple = ()) -> tuple[jax.Array, float]:
  """(inverse frequencies [rotary_dim / 2] float32, cos/sin factor) of HF's RoPE variants.

  `scaling` is ModelConfig.rope_scaling: () for the default RoPE; "proportional" (Gemma 4)
  keeps the default frequencies of the first partial_rotary_factor · rotary_dim / 2 pairs and
  zeroes the rest (unturned features; exponents stay over the whole width); "linear" divides every
  frequency by `factor`; "yarn" blends interpolated (÷ factor) and original frequencies with a
  linear ramp between the dimensions that turn `beta_fast` and `beta_slow` times over
  `original_max_position_embeddings`, and scales cos/sin by the attention factor
  (0.1 · ln(factor) + 1 unless given): transformers' `_compute_yarn_parameters`, in float32.
  "llama3" (Llama 3.1) divides by `factor` the frequencies whose wavelength exceeds
  original_max_position_embeddings / low_freq_factor, keeps those shorter than
  original_max_position_embeddings / high_freq_factor, and blends the two linearly between.
  "dynamic" (NTK) raises θ to θ · (factor · L / M − (factor − 1))^(d / (d − 2)) for a context of
  L tokens (M = max_position_embeddings), with L fixed at the whole extended context M · factor,
  as vLLM does. transformers recomputes θ in every forward from the longest position in it, so
  its outputs depend on how the tokens were grouped into forwards and no speculative decoding
  could reproduce its plain decoding; the two agree for a forward spanning M · factor tokens.
  """
  s = dict(scaling)
  kind = s.get("rope_type", "default")
  if kind == "dynamic":  # in float32, step by step as transformers computes it
    f32 = jnp.float32
    factor, length = f32(s["factor"]), f32(s["max_position_embeddings"])
    stretch = factor * (length * factor) / length - (factor - 1)
    theta = f32(theta) * stretch ** f32(rotary_dim / (rotary_dim - 2))
  base = theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
  if kind in ("default", "dynamic"):
    return 1.0 / base, 1.0
  if kind == "proportional":  # Gemma 4: the first pairs turn, the rest keep frequency 0
    turned = int(s.get("partial_rotary_factor", 1.0) * rotary_dim // 2)
    inv = jnp.where(jnp.arange(rotary_dim // 2) < turned, 1.0 / base, 0.0)
    return inv / s.get("factor", 1.0), 1.0
  factor = s["factor"]
  if kind == "linear":
    return (1.0 / base) / factor, 1.0
  if kind == "llama3":
    return _llama3_frequencies(1.0 / base, s), 1.0
  if kind != "yarn":
    raise ValueError(f"unknown RoPE scaling {kind!r}")

  def mscale(scale: float, m: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention = s.get("attention_factor")
  if attention is None:
    if s.get("mscale") and s.get("mscale_all_dim"):
      attention = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
    else:
      attention = mscale(factor)
  original = s["original_max_position_embeddings"]

  def correction_dim(rotations: float) -> float:
    return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
  if s.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, rotary_dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  ramp = jnp.clip((jnp.arange(rotary_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolated = 1 - ramp
  inv = (1.0 / (factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated
  return inv, float(attention)


def _llama3_frequencies(inv: jax.Array, s: dict) -> jax.Array:
  """Llama 3.1's banded scaling of the default frequencies `inv` (see rope_frequencies)."""
  factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
  original = s["original_max_position_embeddings"]
  wavelength = 2 * math.pi / inv
  long = wavelength > original / low
  scaled = jnp.where(long, inv / factor, inv)
  smooth = (original / wavelength - low) / (high - low)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  between = ~(wavelength < original / high) & ~long
  return jnp.where(between, blended, scaled)


def rope_tables(
  positions: jax.Array, rotary_dim: int, theta: float, scaling: tuple = ()
) -> tuple[jax.Array, jax.Array]:
  """cos/sin tables [*positions.shape, rotary_dim] in float32 (HF RoPE; see rope_frequencies)."""
  inv_freq, attention = rope_frequencies(rotary_dim, theta, scaling)
  freqs = positions.astype(jnp.float32)[..., None] * inv_freq
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  if attention == 1.0:
    return jnp.cos(emb), jnp.sin(emb)
  return jnp.cos(emb) * attention, jnp.sin(emb) * attention


def apply_rope(
  x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False
) -> jax.Array:
  """Rotates the first rotary_dim features of x [B, T, H, D] (rotate-half convention).

  cos/sin are [B, T, rotary_dim]; features past rotary_dim pass through (partial rotary).
  `interleaved` (DeepSeek's layout): the rotary features are stored as pairs (x0, x1), (x2, x3),
  …; they are laid out as [x0, x2, …; x1, x3, …] first (what transformers' interleaved RoPE
  returns) and rotated half-split. Queries and keys share the layout, so their dot products are
  those of the rotated pairs.
  """
  rd = cos.shape[-1]
  xf = x.astype(jnp.float32)
  x_rot, x_pass = xf[..., :rd], xf[..., rd:]
  if interleaved:
    x_rot = jnp.concatenate([x_rot[..., 0::2], x_rot[..., 1::2]], axis=-1)
  x1, x2 = x_rot[..., : rd // 2], x_rot[..., rd // 2 :]
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  out = jnp.concatenate([x_rot * c + rotated * s, x_pass], axis=-1)
  return out.astype(x.dtype)


# --------------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------------


def activation(name: str):
  """The dense MLP's gate activation (ModelConfig.hidden_act): silu, or tanh-approximated GELU."""
  if name == "gelu_pytorch_tanh":
    return lambda x: jax.nn.gelu(x, approximate=True)
  return jax.nn.silu


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x²) + eps) over the last axis in float32, without a learned scale (Gemma 4's
  value norm)."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


class Attention(nn.Module):
  """GQA self-attention of a block over [committed prefix in the decoding state; the block].

  `kv` is this layer segment's state entry (jaxspec/state/) or None (no cache: the block
  attends to itself only); `layer` indexes the segment's stacked layers; `window` is this
  layer's sliding window, if any. gpt-oss adds learned per-head sink logits (`sinks`);
  MiMo-V2-Flash's `sliding` layers have their own KV head count and sinks
  (`ModelConfig.layer_kv_heads`, `has_sinks`), its values are narrower than its keys
  (`value_head_dim`) and scaled before they are stored (`attention_value_scale`). Gemma 4's
  full layers have their own head width and KV heads (`attention_head_dim`), values equal to
  the keys' projection where `attention_k_eq_v`, RMS-normed values and a unit softmax scale;
  its `kv_shared` layers compute queries only and attend to `shared` (their source layer's
  K/V). Returns (out, kv, source): `source` is what a KV-shared layer reading this one needs.
  """

  config: ModelConfig
  sliding: bool = False  # a sliding-window layer (its shape may differ: MiMo, Gemma 4)
  kv_shared: bool = False  # reads another layer's K/V (Gemma 4)

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
    window: attention_lib.Window | None = None,
    shared: attention_lib.SharedSource | None = None,
  ) -> tuple[jax.Array, Any, attention_lib.SharedSource | None]:
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    head_dim = c.attention_head_dim(self.sliding)
    gated = c.attention_output_gate  # q_proj yields [query; gate] per head
    q = Dense(
      (c.num_heads, 2 * head_dim if gated else head_dim),
      ("embed", "heads", "head_dim"),
      c.attention_bias,
      name="q_proj",
      **dense,
    )(x)
    gate = None
    if gated:
      q, gate = q[..., :head_dim], q[..., head_dim:]
    per_layer_norm = c.qk_norm and c.qk_norm_type == "per_layer"
    norm = dict(eps=c.rms_norm_eps, param_dtype=c.param_dtype, offset=c.norm_offset)
    if per_layer_norm:  # MiniMax-M2: over all heads at once
      q_axes = ("heads", "head_dim")
      q = HeadsRMSNorm((c.num_heads, head_dim), q_axes, name="q_norm", **norm)(q)
    elif c.qk_norm:
      q = RMSNorm(head_dim, axis_name="head_dim", name="q_norm", **norm)(q)
    q = sharding.constrain_activation(apply_rope(q, cos, sin), "heads", "head_dim")
    sinks = None
    if c.attention_sinks or (c.sliding_attention_sinks and self.sliding):
      sinks = self.param(
        "sinks",
        nn.with_logical_partitioning(nn.initializers.zeros, ("heads",)),
        (c.num_heads,),
        dtype_of(c.param_dtype),
      )
    options = dict(chunk=c.options.attention_chunk, window=window, sinks=sinks)
    source = None
    if self.kv_shared:
      if shared is None:
        raise ValueError("a KV-shared attention layer needs its source layer's K/V (shared=)")
      impl = attention_lib.resolve_impl(c.options.attention_impl)
      if impl == "pallas" and shared.after is not None and window is None and sinks is None:
        scale = c.attention_scale
        xla = lambda: attention_lib.attend_shared(q, shared, start, block_mask, scale, **options)
        out = attention_lib.attend_pallas(
          q, shared.after, shared.layer, start, block_mask, scale, reference=xla
        )
      else:
        out = attention_lib.attend_shared(
          q, shared, start, block_mask, c.attention_scale, **options
        )
    else:
      kv_heads = c.attention_kv_heads(self.sliding)
      k = Dense(
        (kv_heads, head_dim),
        ("embed", "kv_heads", "head_dim"),
        c.attention_bias,
        name="k_proj",
        **dense,
      )(x)
      if c.attention_k_eq_v and not self.sliding:  # Gemma 4's full layers: v = k's projection
        v = k
      else:
        v = Dense(
          (kv_heads, c.attention_value_dim(self.sliding)),
          ("embed", "kv_heads", "head_dim"),
          c.attention_bias,
          name="v_proj",
          **dense,
        )(x)
      if c.attention_value_scale != 1.0:  # MiMo: values scaled before they are stored
        v = (v.astype(jnp.float32) * c.attention_value_scale).astype(v.dtype)
      if per_layer_norm:
        k_axes = ("kv_heads", "head_dim")
        k = HeadsRMSNorm((kv_heads, head_dim), k_axes, name="k_norm", **norm)(k)
      elif c.qk_norm:
        k = RMSNorm(head_dim, axis_name="head_dim", name="k_norm", **norm)(k)
      if c.family.value_norm:  # values RMS-normed, without a scale
        v = rms_normalize(v, c.rms_norm_eps)
      k = sharding.constrain_activation(apply_rope(k, cos, sin), "kv_heads", "head_dim")
      v = sharding.constrain_activation(v, "kv_heads", "head_dim")
      out, kv, source = attention_lib.attention_block(
        q, k, v, kv, layer, start, block_mask, c.attention_scale, c.options.attention_impl,
        **options,
      )
    if gate is not None:
      out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
    out = Dense(
      (c.hidden_size,),
      ("heads", "head_dim", "embed"),
      c.attention_out_bias,
      name="o_proj",
      in_dims=2,
      **dense,
    )(out)
    return sharding.constrain_activation(out, "embed"), kv, source


class MLP(nn.Module):
  """Gated feed-forward: down(act(gate(x)) · up(x)), act = silu (SwiGLU) or GELU (Gemma)."""

  config: ModelConfig
  intermediate_size: int

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    gate = Dense((self.intermediate_size,), ("embed", "mlp"), name="gate_proj", **dense)(x)
    up = Dense((self.intermediate_size,), ("embed", "mlp"), name="up_proj", **dense)(x)
    hidden = sharding.constrain_activation(activation(c.hidden_act)(gate) * up, "mlp")
    out = Dense((c.hidden_size,), ("mlp", "embed"), name="down_proj", **dense)(hidden)
    return sharding.constrain_activation(out, "embed")
