"""Gated DeltaNet: the gated delta rule and the linear-attention layer of Qwen3-Next / Qwen3.5.

The gated delta rule keeps, per value head, a recurrent state S [Dk, Dv] (float32) and for each
token t (query q_t, key k_t, value v_t, log-decay g_t ≤ 0, write strength β_t ∈ (0, 1))

    S ← exp(g_t) · S
    S ← S + k_t ⊗ β_t (v_t − Sᵀ k_t)        (the delta rule: correct what S predicts for k_t)
    o_t = Sᵀ q_t

Three forms, same numbers (and a fourth for draft trees). The two pure oracles,
`recurrent_reference` and `chunked`, live beside the Pallas kernel in
pallas_kernels/gated_delta/reference.py (which imports nothing from jaxspec); this module calls
`chunked` as its XLA path.

* `recurrent_reference`: the recurrence above, one token at a time (`lax.scan`), written as
  literally as possible. The oracle of the tests.
* `recurrent`: the same scan, also returning the state after every position ([B, T, H, Dk, Dv]):
  the form for single tokens and short verify blocks, whose per-position snapshots let chain
  verification commit any accepted prefix.
* `chunked`: the WY / UT-transform formulation of the FLA library (and transformers'
  `torch_chunk_gated_delta_rule`): inside a chunk of C tokens the C delta-rule updates are
  condensed into one unit-lower-triangular inverse (`unit_lower_inverse`, all matmuls) and a
  few more matmuls; a `lax.scan` over chunks carries S. The form for prefill and long blocks
  (cost O(T·C·D + T·D²) instead of T sequential rank-1 updates). `chunked_impl` picks it or
  its Pallas kernel (pallas_kernels/gated_delta) by `RunOptions.linear_attention_impl`.

* `tree_recurrent`: the recurrent form over a verify block whose tokens form a tree (each node
  resumes from its parent's state, the root from the committed one); per-node outputs and states.

All of them take q, k [B, T, H, Dk] (already L2-normalised and scaled, and repeated to the value
heads), v [B, T, H, Dv], g, β [B, T, H] and an initial state [B, H, Dk, Dv] (None: zeros), and
compute in float32. A token with g = 0 and β = 0 leaves S unchanged, which is how padding and
positions past a sequence's valid length are kept out of the state.

`GatedDeltaNet` is the layer: in-projections, a causal depthwise conv1d (window K) over the
q/k/v channels with SiLU, the rule, a gated RMSNorm (norm(o) · silu(z)) and the out-projection.
Its decoding state (jaxspec/state/linear.py: `LinearState`) holds the conv window and S, a
fixed number of bytes per sequence whatever the context length.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.models.attention import block_visibility
from jaxspec.models.layers import Dense, dtype_of
from jaxspec.models.platform import kernel_or_reference
from pallas_kernels.gated_delta.reference import HIGHEST, as_float32, chunked, zeros_state


def _delta_step(s, q_t, k_t, v_t, g_t, b_t) -> tuple[jax.Array, jax.Array]:
  """One token of the rule on states s [B, H, Dk, Dv]: (the new state, its output Sᵀ q)."""
  s = s * jnp.exp(g_t)[..., None, None]
  predicted = jnp.einsum("bhkv,bhk->bhv", s, k_t, precision=HIGHEST)
  delta = (v_t - predicted) * b_t[..., None]
  s = s + jnp.einsum("bhk,bhv->bhkv", k_t, delta, precision=HIGHEST)
  return s, jnp.einsum("bhkv,bhk->bhv", s, q_t, precision=HIGHEST)


def recurrent(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The recurrent form with per-position snapshots: (out [B, T, H, Dv], states [B, T, H, Dk,
  Dv], the state after each position; states[:, -1] is the final one)."""
  q, k, v, g, beta = as_float32(q, k, v, g, beta)
  s0 = zeros_state(q, v) if state is None else state.astype(jnp.float32)

  def step(s, x):
    s, out = _delta_step(s, *x)
    return s, (out, s)

  xs = [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
  _, (out, states) = jax.lax.scan(step, s0, xs)
  return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)


def chunked_impl(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  state: jax.Array | None,
  chunk_size: int,
  impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
  """`chunked` by `RunOptions.linear_attention_impl`: "pallas" runs the Pallas kernel
  (pallas_kernels/gated_delta, Triton) on CUDA/ROCm, in interpret mode on CPU, and `chunked` on
  TPU and other platforms, chosen when the program is lowered (jaxspec/models/platform.py);
  "auto" and "xla" run `chunked`."""
  reference = lambda: chunked(q, k, v, g, beta, state, chunk_size)
  if impl == "pallas":
    from pallas_kernels.gated_delta import gated_delta_rule  # pylint: disable=import-outside-toplevel

    def kernel(interpret: bool) -> tuple[jax.Array, jax.Array]:
      return gated_delta_rule(
        q, k, v, g, beta, state, chunk_size, impl="pallas", interpret=interpret
      )

    return kernel_or_reference(kernel, reference)
  return reference()


def tree_structure(mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(parents [B, T], −1 for the root; depths [B, T]) of a tree block from its ancestor-or-self
  mask [B, T, T] (the mask the attention layers get). A node's ancestors form its root path,
  whose indices increase downwards (parents come before their children), so the parent is the
  strict ancestor of largest index and the depth is the number of strict ancestors."""
  t = mask.shape[-1]
  idx = jnp.arange(t)
  strict = mask & (idx[None, :] != idx[:, None])
  parents = jnp.max(jnp.where(strict, idx, -1), axis=-1).astype(jnp.int32)
  return parents, jnp.sum(strict, axis=-1).astype(jnp.int32)


def tree_recurrent(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  g: jax.Array,
  beta: jax.Array,
  parents: jax.Array,
  state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The gated delta rule over a tree block: node i's state is its parent's state updated by
  node i (a node with parent −1, the root, updates the initial state). parents [B, T] with
  parents[:, i] < i. Returns (out [B, T, H, Dv], states [B, T, H, Dk, Dv], the state after each
  node, i.e. at the end of its root path).

  A `lax.scan` over the nodes in index order (topological, since parents come first) carries
  every node's state and gathers the parent's. Why this form: the per-node states must be kept
  anyway (the accepted node's is committed, like chain verification's per-position snapshots),
  and this does the least work that produces them, T rank-1 updates, the same as `recurrent`
  over a chain of T tokens. The chunked UT form with the ancestor mask in place of the causal
  one gives the outputs in one solve, but the per-node states then cost a T × T masked sum of
  rank-1 terms (T² · Dk · Dv); a level-by-level sweep updates all T nodes at each of the D
  depths (T · D · Dk · Dv). Per node the arithmetic is exactly `recurrent`'s along its root path.
  """
  q, k, v, g, beta = as_float32(q, k, v, g, beta)
  s0 = zeros_state(q, v) if state is None else state.astype(jnp.float32)
  b, t = q.shape[:2]
  rows = jnp.arange(b)
  parents = parents.astype(jnp.int32)
  # Slot 0 holds the initial state, slot i + 1 node i's. Each step reads the *next* node's
  # parent state after its write: a read of the buffer before the in-place write would make
  # XLA copy the whole carried buffer every step (measured 18× slower at T = 17 on CPU).
  buf = jnp.zeros((b, t + 1, *s0.shape[1:]), jnp.float32).at[:, 0].set(s0)
  next_parents = jnp.concatenate([parents[:, 1:], jnp.full((b, 1), -1, jnp.int32)], axis=1)

  def step(carry, x):
    buf, s = carry  # s: this node's parent state
    i, next_parent, *token = x
    s, out = _delta_step(s, *token)
    buf = jax.lax.dynamic_update_index_in_dim(buf, s, i + 1, axis=1)
    return (buf, buf[rows, next_parent + 1]), out

  xs = [jnp.arange(t), jnp.moveaxis(next_parents, 1, 0)]
  xs += [jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta)]
  (buf, _), out = jax.lax.scan(step, (buf, buf[rows, parents[:, 0] + 1]), xs)
  return jnp.moveaxis(out, 0, 1), buf[:, 1:]


# --------------------------------------------------------------------------------------------------
# Pieces of the layer
# --------------------------------------------------------------------------------------------------


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
  """x / sqrt(Σx² + eps) over the last axis, in float32 (FLA's and transformers' l2norm)."""
  xf = x.astype(jnp.float32)
  return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def causal_conv(x: jax.Array, window: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise conv1d over time, then SiLU: out[t] = silu(Σ_j w[j] · z[t + j]) with z the
  K − 1 previous inputs (`window` [B, K−1, C]) followed by x [B, T, C]; w [K, C].

  Returns (out [B, T, C], z [B, K−1+T, C]: the conv windows of every position, which the
  decoding state slices at the committed one)."""
  kernel = w.shape[0]
  z = jnp.concatenate([window.astype(x.dtype), x], axis=1)
  t = x.shape[1]
  acc = sum(z[:, j : j + t].astype(jnp.float32) * w[j].astype(jnp.float32) for j in range(kernel))
  return jax.nn.silu(acc).astype(x.dtype), z


def tree_conv_index(parents: jax.Array, depths: jax.Array, kernel: int) -> jax.Array:
  """[B, T, K] where node i's conv taps sit in z = [window (K−1), block (T)]: tap d (d = 0 the
  node itself, d = 1..K−1 its ancestor at distance d along the parent chain) is z[K−1 + that
  ancestor], or, past the root, the committed window's entry d − depth(i) back from its end."""
  b, t = parents.shape
  rows = jnp.arange(b)[:, None]
  taps, cur = [], jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  for d in range(kernel):  # K − 1 steps up the parent chain
    taps.append(jnp.where(cur >= 0, kernel - 1 + cur, kernel - 1 - (d - depths)))
    cur = jnp.where(cur >= 0, parents[rows, jnp.maximum(cur, 0)], -1)
  return jnp.stack(taps, axis=-1)


def tree_causal_conv(
  x: jax.Array, window: jax.Array, w: jax.Array, parents: jax.Array, depths: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """`causal_conv` for a tree block: node i convolves itself and its K − 1 nearest ancestors
  (then the committed window past the root), silu(Σ_d w[K−1−d] · tap_d). Returns (out [B, T, C],
  z [B, K−1+T, C] = window then the block's inputs in node order, as `causal_conv`)."""
  kernel = w.shape[0]
  z = jnp.concatenate([window.astype(x.dtype), x], axis=1)
  idx = tree_conv_index(parents, depths, kernel)  # [B, T, K]
  rows = jnp.arange(x.shape[0])[:, None]
  acc = sum(
    z[rows, idx[..., d]].astype(jnp.float32) * w[kernel - 1 - d].astype(jnp.float32)
    for d in range(kernel)
  )
  return jax.nn.silu(acc).astype(x.dtype), z


def gated_rmsnorm(x: jax.Array, gate: jax.Array, w: jax.Array, eps: float) -> jax.Array:
  """w · rmsnorm(x) · silu(gate), the norm in float32 (transformers' Qwen3NextRMSNormGated)."""
  dt = x.dtype
  xf = x.astype(jnp.float32)
  xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  y = w.astype(jnp.float32) * xf.astype(dt).astype(jnp.float32)
  return (y * jax.nn.silu(gate.astype(jnp.float32))).astype(dt)


class GatedDeltaNet(nn.Module):
  """The linear-attention token mixer of a Qwen3-Next / Qwen3.5 layer.

  `entry` is this segment's `LinearState` (or None: no state, the block starts from zeros);
  `layer` indexes the segment's layers; `start` [B] is the block's first position and `valid`
  [B] (or None) how many of its tokens belong to each sequence (prefill of padded prompts);
  `block_mask` [B, T, T] (or None), the ancestor-or-self mask of a tree verify block: the conv
  and the rule then run along each node's root path (`tree_causal_conv`, `tree_recurrent`) and
  every node's state is kept for `LinearState.commit_path`.
  Qwen3-Next projects q, k, v, z and b, a with two fused, per-key-head-grouped matrices
  (`in_proj_qkvz`, `in_proj_ba`); Qwen3.5 with four plain ones. Returns (out, entry).
  """

  config: ModelConfig

  def _split_fused(self, x: jax.Array):
    """Qwen3-Next's grouped in_proj_qkvz / in_proj_ba → q, k, v, z, b, a (its
    fix_query_key_value_ordering)."""
    c = self.config
    nk, nv, dk, dv = (
      c.linear_num_key_heads,
      c.linear_num_value_heads,
      c.linear_key_head_dim,
      c.linear_value_head_dim,
    )
    r = nv // nk
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    bsz, t = x.shape[:2]
    qkvz = Dense((nk * (2 * dk + 2 * r * dv),), ("embed", None), name="in_proj_qkvz", **dense)(x)
    ba = Dense((2 * nv,), ("embed", None), name="in_proj_ba", **dense)(x)
    qkvz = qkvz.reshape(bsz, t, nk, 2 * dk + 2 * r * dv)
    q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + r * dv], axis=-1)
    ba = ba.reshape(bsz, t, nk, 2 * r)
    b, a = ba[..., :r].reshape(bsz, t, nv), ba[..., r:].reshape(bsz, t, nv)
    qkv = jnp.concatenate(
      [q.reshape(bsz, t, -1), k.reshape(bsz, t, -1), v.reshape(bsz, t, -1)], axis=-1
    )
    return qkv, z.reshape(bsz, t, nv, dv), b, a

  def _split_plain(self, x: jax.Array):
    c = self.config
    nk, nv, dk, dv = (
      c.linear_num_key_heads,
      c.linear_num_value_heads,
      c.linear_key_head_dim,
      c.linear_value_head_dim,
    )
    dense = dict(dtype=c.dtype, param_dtype=c.param_dtype)
    bsz, t = x.shape[:2]
    qkv = Dense((2 * nk * dk + nv * dv,), ("embed", None), name="in_proj_qkv", **dense)(x)
    z = Dense((nv * dv,), ("embed", None), name="in_proj_z", **dense)(x)
    b = Dense((nv,), ("embed", None), name="in_proj_b", **dense)(x)
    a = Dense((nv,), ("embed", None), name="in_proj_a", **dense)(x)
    return qkv, z.reshape(bsz, t, nv, dv), b, a

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    entry: Any,
    layer: jax.Array,
    start: jax.Array,
    valid: jax.Array | None = None,
    block_mask: jax.Array | None = None,
  ) -> tuple[jax.Array, Any]:
    c = self.config
    nk, nv, dk, dv = (
      c.linear_num_key_heads,
      c.linear_num_value_heads,
      c.linear_key_head_dim,
      c.linear_value_head_dim,
    )
    pdt = dtype_of(c.param_dtype)
    bsz, t = x.shape[:2]
    if c.family.linear_projections == "fused":
      qkv, z, b, a = self._split_fused(x)
    else:
      qkv, z, b, a = self._split_plain(x)
    channels = qkv.shape[-1]
    conv_w = self.param(
      "conv_kernel",
      nn.with_logical_partitioning(nn.initializers.normal(0.2), (None, None)),
      (c.linear_conv_kernel_dim, channels),
      pdt,
    )
    dt_bias = self.param(
      "dt_bias", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (nv,), pdt
    )
    a_log = self.param(
      "A_log",
      nn.with_logical_partitioning(
        lambda key, shape, dtype: jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0)),
        (None,),
      ),
      (nv,),
      pdt,
    )
    norm_w = self.param(
      "norm", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (dv,), pdt
    )

    if entry is None:
      window, s0 = jnp.zeros((bsz, c.linear_conv_kernel_dim - 1, channels), x.dtype), None
    else:
      window, s0 = entry.initial(layer, start)
    tree = None
    if block_mask is not None:  # a tree block: conv and state along each node's root path
      if entry is None or not entry.has_pending:
        raise ConfigError(
          f"a tree block of {t} tokens needs per-node states: at most "
          f"RunOptions.linear_snapshots = {c.options.linear_snapshots} tokens"
        )
      tree = tree_structure(block_visibility(block_mask, bsz, t))
      mixed, conv_inputs = tree_causal_conv(qkv, window, conv_w, *tree)
    else:
      mixed, conv_inputs = causal_conv(qkv, window, conv_w)
    q, k, v = jnp.split(mixed, [nk * dk, 2 * nk * dk], axis=-1)
    q = l2norm(q.reshape(bsz, t, nk, dk)) * dk**-0.5
    k = l2norm(k.reshape(bsz, t, nk, dk))
    v = v.reshape(bsz, t, nv, dv)
    if nv != nk:  # each q/k head serves nv / nk consecutive value heads
      q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
      a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    )
    if tree is not None:  # every node's state, for commit_path
      out, states = tree_recurrent(q, k, v, g, beta, tree[0], s0)
      entry = entry.write_snapshots(layer, conv_inputs, s0, states)
    elif entry is not None and entry.has_pending:  # short block: every position's state
      out, states = recurrent(q, k, v, g, beta, s0)
      entry = entry.write_snapshots(layer, conv_inputs, s0, states)
    else:
      if valid is not None:  # tokens past a sequence's valid length leave the state alone
        inside = jnp.arange(t)[None, :, None] < valid[:, None, None]
        g, beta = jnp.where(inside, g, 0.0), jnp.where(inside, beta, 0.0)
      if t == 1:
        out, states = recurrent(q, k, v, g, beta, s0)
        final = states[:, -1]
      else:
        out, final = chunked_impl(
          q, k, v, g, beta, s0, c.options.linear_chunk, c.options.linear_attention_impl
        )
      if entry is not None:
        n = jnp.full((bsz,), t, jnp.int32) if valid is None else jnp.clip(valid, 0, t)
        entry = entry.write_final(layer, n, conv_inputs, final)
    out = gated_rmsnorm(out.astype(x.dtype), z, norm_w, c.rms_norm_eps)
    out = Dense(
      (c.hidden_size,), (None, "embed"), name="out_proj", dtype=c.dtype, param_dtype=c.param_dtype
    )(out.reshape(bsz, t, nv * dv))
    return out, entry
