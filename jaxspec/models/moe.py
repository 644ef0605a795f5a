"""Mixture-of-experts feed-forward: top-k routers and interchangeable expert backends.

Routers:
  * softmax (Qwen3-MoE): softmax over expert logits, top-k, optional renormalisation.
  * sigmoid (GLM-4.5 / DeepSeek-V3): sigmoid scores; the choice uses scores + a correction bias,
    restricted to the `topk_group` best of `n_group` groups (a group scores the sum of its top-2);
    weights are the unbiased scores, optionally renormalised, times `routed_scaling_factor`.

Expert backends (same numbers, different cost):
  * dense: every expert on every token, combined with a sparse weight matrix. The oracle.
  * ragged: the N·k (token, expert) pairs sorted by expert and run as grouped matmuls with
    `jax.lax.ragged_dot`; FLOPs proportional to k, not to the number of experts.
  * gather: each token reads only its k experts' weights (decode and short verify blocks).
  * auto (default): gather for few tokens, else ragged (dense on CPU); see pick_backend.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models.layers import MLP, dtype_of, normal_init, weight
from jaxspec.quant.formats import materialize, take


def route(
  config: ModelConfig, logits: jax.Array, correction_bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """Top-k routing. logits [N, E] float32 → (weights [N, k] float32, expert ids [N, k] int32)."""
  k = config.num_experts_per_tok
  if config.router == "softmax":
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if config.norm_topk_prob:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)

  scores = jax.nn.sigmoid(logits)
  choice = scores + correction_bias[None, :]
  n, e = choice.shape
  if config.n_group > 1:
    grouped = choice.reshape(n, config.n_group, e // config.n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
    _, top_groups = jax.lax.top_k(group_scores, config.topk_group)
    group_keep = (
      jnp.zeros_like(group_scores, dtype=bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    )
    keep = jnp.repeat(group_keep, e // config.n_group, axis=1)
    choice = jnp.where(keep, choice, -jnp.inf)
  _, ids = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, ids, axis=-1)
  if config.norm_topk_prob:
    weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
  return weights * config.routed_scaling_factor, ids.astype(jnp.int32)


def experts_dense(
  x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
  """Every expert on every token; x [N,H], gate/up [E,H,I], down [E,I,H] → [N,H]."""
  num_experts = gate.shape[0]
  combine = (
    jnp.zeros((x.shape[0], num_experts), jnp.float32)
    .at[jnp.arange(x.shape[0])[:, None], ids]
    .add(weights)
  )
  g = jnp.einsum("nh,ehi->nei", x, gate, preferred_element_type=jnp.float32)
  u = jnp.einsum("nh,ehi->nei", x, up, preferred_element_type=jnp.float32)
  hmid = (jax.nn.silu(g) * u).astype(x.dtype)
  y = jnp.einsum("nei,eih->neh", hmid, down, preferred_element_type=jnp.float32)
  return jnp.einsum("neh,ne->nh", y, combine).astype(x.dtype)


def experts_ragged(
  x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
  """Tokens sorted by expert, grouped matmuls via ragged_dot; same result as experts_dense."""
  n, k = ids.shape
  num_experts = gate.shape[0]
  flat_ids = ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // k
  xs = x[token_of]
  group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
  pet = jnp.float32 if x.dtype == jnp.float32 else None
  g = jax.lax.ragged_dot(xs, gate, group_sizes, preferred_element_type=pet)
  u = jax.lax.ragged_dot(xs, up, group_sizes, preferred_element_type=pet)
  hmid = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
  y = jax.lax.ragged_dot(hmid, down, group_sizes, preferred_element_type=jnp.float32)
  y = y * weights.reshape(-1)[order][:, None]
  return jnp.zeros((n, x.shape[1]), jnp.float32).at[token_of].add(y).astype(x.dtype)


def experts_gather(
  x: jax.Array, weights: jax.Array, ids: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array
) -> jax.Array:
  """Reads only the selected experts' weights per token: the decode path.

  With N·k (token, expert) pairs below the number of experts this touches fewer weight bytes
  than any grouped matmul (decode is memory bound), and it needs no sort. The weights may be
  quantized (jaxspec.quant): only the selected experts are dequantized.
  """
  dt = x.dtype
  g = jnp.einsum("nh,nkhi->nki", x, take(gate, ids, dt), preferred_element_type=jnp.float32)
  u = jnp.einsum("nh,nkhi->nki", x, take(up, ids, dt), preferred_element_type=jnp.float32)
  hmid = (jax.nn.silu(g) * u).astype(x.dtype)
  y = jnp.einsum("nki,nkih->nkh", hmid, take(down, ids, dt), preferred_element_type=jnp.float32)
  return jnp.einsum("nkh,nk->nh", y, weights).astype(x.dtype)


EXPERT_BACKENDS = {"dense": experts_dense, "ragged": experts_ragged, "gather": experts_gather}


def pick_backend(name: str, num_pairs: int, num_experts: int) -> str:
  """Resolves "auto": gather when the N·k pairs need fewer expert reads than there are experts
  (decode, short verify blocks); otherwise grouped matmuls on accelerators and the dense oracle
  on CPU, where XLA lowers ragged_dot to a masked dense product anyway."""
  if name != "auto":
    return name
  if num_pairs <= num_experts:
    return "gather"
  return "dense" if jax.default_backend() == "cpu" else "ragged"


class MoE(nn.Module):
  """Routed experts (+ optional always-on shared experts)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    pdt = dtype_of(c.param_dtype)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    router = weight(
      self,
      "router",
      nn.with_logical_partitioning(normal_init(), ("embed", None)),
      (h, e),
      jnp.float32,
    )
    bias = None
    if c.router == "sigmoid":
      bias = self.param(
        "e_score_correction_bias",
        nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        (e,),
        jnp.float32,
      )
    gate = weight(
      self,
      "gate_proj",
      nn.with_logical_partitioning(normal_init(), ("expert", "embed", "mlp")),
      (e, h, i),
      pdt,
    )
    up = weight(
      self,
      "up_proj",
      nn.with_logical_partitioning(normal_init(), ("expert", "embed", "mlp")),
      (e, h, i),
      pdt,
    )
    down = weight(
      self,
      "down_proj",
      nn.with_logical_partitioning(normal_init(), ("expert", "mlp", "embed")),
      (e, i, h),
      pdt,
    )

    lead = x.shape[:-1]
    xf = x.reshape(-1, h)
    # The router runs in float32 (HF keeps gate.weight and the bias in fp32 too).
    logits = xf.astype(jnp.float32) @ materialize(router, jnp.float32)
    weights, ids = route(c, logits, bias)
    # Routing statistics (no-ops unless 'intermediates' is mutable): the raw router logits
    # [N, E] (routing margins for parity checks, router sensitivity for quantization), the
    # fraction of routed slots per expert and the mean normalised router score (load balancing).
    self.sow("intermediates", "router_logits", logits)
    self.sow(
      "intermediates",
      "expert_load",
      jnp.bincount(ids.reshape(-1), length=e).astype(jnp.float32) / ids.size,
    )
    scores = jax.nn.softmax(logits) if c.router == "softmax" else jax.nn.sigmoid(logits)
    self.sow(
      "intermediates", "router_score", jnp.mean(scores / jnp.sum(scores, -1, keepdims=True), axis=0)
    )
    dt = dtype_of(c.dtype)
    backend = pick_backend(c.moe_backend, ids.size, e)
    if backend == "gather":  # reads (and dequantizes) only the selected experts
      y = experts_gather(xf.astype(dt), weights, ids, gate, up, down)
    else:
      y = EXPERT_BACKENDS[backend](
        xf.astype(dt),
        weights,
        ids,
        materialize(gate, dt),
        materialize(up, dt),
        materialize(down, dt),
      )
    y = y.reshape(*lead, h)
    if c.n_shared_experts:
      y = y + MLP(c, c.shared_intermediate_size, name="shared_experts")(x)
    return y
