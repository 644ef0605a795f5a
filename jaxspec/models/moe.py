"""Mixture-of-experts feed-forward: top-k routers and interchangeable expert backends.

Routers:
  * softmax (Qwen3-MoE): softmax over expert logits, top-k, optional renormalisation.
  * gemma4 (Gemma 4): softmax over the logits of the RMS-normed layer input times a learned
    scale / sqrt(H), top-k renormalised, each weight times its expert's learned scale.
  * sigmoid (GLM-4.5 / DeepSeek-V3): sigmoid scores; the choice uses scores + a correction bias,
    restricted to the `topk_group` best of `n_group` groups (a group scores the sum of its top-2);
    weights are the unbiased scores, optionally renormalised, times `routed_scaling_factor`.

Expert backends (same numbers, different cost):
  * dense: every expert on every token, combined with a sparse weight matrix. The oracle.
  * ragged: the N·k (token, expert) pairs sorted by expert and run as grouped matmuls with
    `jax.lax.ragged_dot`; FLOPs proportional to k, not to the number of experts.
  * gather: each token reads only its k experts' weights (decode and short verify blocks).
  * loop: the distinct selected experts one after another, each a plain matmul over all N
    tokens: every selected expert's weights read once, in place.
  * auto (default): on CPU the loop; elsewhere gather for few tokens, else ragged; see
    pick_backend.
  * ep, ep_replicate, ep_all_to_all: experts sharded over the mesh's `expert` axis, each device
    running its own with the backend auto picks for it (jaxspec.models.expert_parallel). "auto"
    becomes "ep" when the step is traced under a mesh (sharding.use_mesh) whose expert axis has
    more than one device and divides the experts; without such a mesh the ep backends run as auto.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxspec import sharding
from jaxspec.config import ModelConfig
from jaxspec.models import expert_parallel as ep
from jaxspec.models.layers import MLP, Dense, dtype_of, normal_init, rms_normalize, weight
from jaxspec.models.platform import kernel_or_reference
from jaxspec.quant.formats import is_quantized, materialize, take


def route(
  config: ModelConfig, logits: jax.Array, correction_bias: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
  """Top-k routing. logits [N, E] float32 → (weights [N, k] float32, expert ids [N, k] int32).

  For "topk_softmax" (gpt-oss) the logits already include the router's bias.
  """
  k = config.num_experts_per_tok
  if config.router == "topk_softmax":
    top, ids = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)
  if config.router in ("softmax", "gemma4"):  # gemma4: the caller scales the weights
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


class Experts(NamedTuple):
  """One MoE layer's routed experts, each weight an array or a QTensor (jaxspec.quant).

  ins: the input projections, (gate [E, H, I], up [E, H, I]) or gpt-oss's fused
    (gate_up [E, H, 2I],); in_biases: their biases ([E, I] / [E, 2I]) or None.
  down: [E, I, H]; down_bias: [E, H] or None.
  act: float32 outputs of the input projections → the down projection's input.
  """

  ins: tuple[Any, ...]
  in_biases: tuple[jax.Array, ...] | None
  down: Any
  down_bias: jax.Array | None
  act: Callable[..., jax.Array]


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up


def clamped_swiglu(gate_up: jax.Array, limit: float, alpha: float) -> jax.Array:
  """gpt-oss's activation over the interleaved gate/up output [..., 2I] (gate at even
  features): (clip(up, ±limit) + 1) · g · σ(alpha · g) with g = min(gate, limit)."""
  gate = jnp.minimum(gate_up[..., 0::2], limit)
  up = jnp.clip(gate_up[..., 1::2], -limit, limit)
  return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def split_geglu(gate_up: jax.Array) -> jax.Array:
  """Gemma 4's activation over the fused gate/up output [..., 2I] (gate first, then up):
  GELU-tanh(gate) · up."""
  gate, up = jnp.split(gate_up, 2, axis=-1)
  return jax.nn.gelu(gate, approximate=True) * up


def _biases(w: Experts) -> tuple:
  return w.in_biases if w.in_biases is not None else (None,) * len(w.ins)


def _combine_matrix(weights: jax.Array, ids: jax.Array, num_experts: int) -> jax.Array:
  """[N, E] float32: each token's routing weight in its experts' columns, 0 elsewhere."""
  n = ids.shape[0]
  return jnp.zeros((n, num_experts), jnp.float32).at[jnp.arange(n)[:, None], ids].add(weights)


def experts_dense(
  x: jax.Array, weights: jax.Array, ids: jax.Array, w: Experts, out_dtype: Any = None
) -> jax.Array:
  """Every expert on every token, combined with a sparse weight matrix: x [N, H] → [N, H]
  (in out_dtype, default x's: float32 keeps partial sums exact for a later reduction)."""
  dt = x.dtype
  combine = _combine_matrix(weights, ids, w.down.shape[0])
  hs = []
  for m, b in zip(w.ins, _biases(w)):
    h = jnp.einsum("nh,ehi->nei", x, materialize(m, dt), preferred_element_type=jnp.float32)
    hs.append(h if b is None else h + b.astype(jnp.float32)[None])
  hmid = w.act(*hs).astype(dt)
  y = jnp.einsum("nei,eih->neh", hmid, materialize(w.down, dt), preferred_element_type=jnp.float32)
  if w.down_bias is not None:
    y = y + w.down_bias.astype(jnp.float32)[None]
  return jnp.einsum("neh,ne->nh", y, combine).astype(out_dtype or dt)


def grouped_matmul(xs: jax.Array, w: Any, group_sizes: jax.Array, impl: str = "auto") -> jax.Array:
  """Rows of xs [M, K] grouped by expert (sizes [E]) times their expert's w [E, K, N] → float32.

  An MXFP4 weight goes to the Pallas grouped matmul (pallas_kernels/mxfp4_gmm, dequantized
  tile by tile) with impl="pallas": the platform's kernel, chosen when the program is lowered
  (jaxspec/models/platform.py): the Triton kernel on CUDA/ROCm (interpret mode on CPU), the
  Mosaic kernel on TPU, ragged_dot elsewhere. Otherwise (and for impl "auto"/"xla") the weight
  is dequantized and `jax.lax.ragged_dot` runs.
  """

  def reference() -> jax.Array:
    return jax.lax.ragged_dot(
      xs, materialize(w, xs.dtype), group_sizes, preferred_element_type=jnp.float32
    )

  if impl == "pallas" and is_quantized(w) and w.format == "mxfp4" and w.axes == (-2,):
    from pallas_kernels.mxfp4_gmm import mxfp4_gmm  # pylint: disable=import-outside-toplevel

    gmm = functools.partial(
      mxfp4_gmm, xs, w.values, w.scales, group_sizes, preferred_element_type=jnp.float32
    )
    return kernel_or_reference(
      lambda interpret: gmm(impl="pallas", interpret=interpret),
      reference,
      tpu=lambda: gmm(impl="pallas_tpu"),
    )
  return reference()


def experts_ragged(
  x: jax.Array,
  weights: jax.Array,
  ids: jax.Array,
  w: Experts,
  impl: str = "auto",
  out_dtype: Any = None,
) -> jax.Array:
  """Tokens sorted by expert, grouped matmuls (`grouped_matmul`); same result as experts_dense."""
  n, k = ids.shape
  num_experts = w.down.shape[0]
  flat_ids = ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // k
  expert_of = flat_ids[order]
  xs = x[token_of]
  group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
  hs = []
  for m, b in zip(w.ins, _biases(w)):
    h = grouped_matmul(xs, m, group_sizes, impl)
    hs.append(h if b is None else h + b.astype(jnp.float32)[expert_of])
  hmid = w.act(*hs).astype(x.dtype)
  y = grouped_matmul(hmid, w.down, group_sizes, impl)
  if w.down_bias is not None:
    y = y + w.down_bias.astype(jnp.float32)[expert_of]
  y = y * weights.reshape(-1)[order][:, None]
  return jnp.zeros((n, x.shape[1]), jnp.float32).at[token_of].add(y).astype(out_dtype or x.dtype)


def experts_gather(
  x: jax.Array, weights: jax.Array, ids: jax.Array, w: Experts, out_dtype: Any = None
) -> jax.Array:
  """Reads only the selected experts' weights per token: the decode path.

  With N·k (token, expert) pairs below the number of experts this touches fewer weight bytes
  than any grouped matmul (decode is memory bound), and it needs no sort. The weights may be
  quantized (jaxspec.quant): only the selected experts are dequantized.
  """
  dt = x.dtype
  hs = []
  for m, b in zip(w.ins, _biases(w)):
    h = jnp.einsum("nh,nkhi->nki", x, take(m, ids, dt), preferred_element_type=jnp.float32)
    hs.append(h if b is None else h + b.astype(jnp.float32)[ids])
  hmid = w.act(*hs).astype(dt)
  y = jnp.einsum("nki,nkih->nkh", hmid, take(w.down, ids, dt), preferred_element_type=jnp.float32)
  if w.down_bias is not None:
    y = y + w.down_bias.astype(jnp.float32)[ids]
  return jnp.einsum("nkh,nk->nh", y, weights).astype(out_dtype or dt)


def experts_loop(
  x: jax.Array, weights: jax.Array, ids: jax.Array, w: Experts, out_dtype: Any = None
) -> jax.Array:
  """The distinct experts the tokens selected, one per loop step, each on all N tokens.

  Reads each selected expert's weights once (no more bytes than gather, fewer whenever tokens
  share an expert) through one dynamic slice per weight, which the loop body feeds to a plain
  matmul; FLOPs are N per selected expert, against k per token for ragged. It is XLA:CPU's fast
  path at every N: there gather copies the selected weights before a batched product, and the
  dense oracle's einsum over experts is slower still (one token, 32 experts of 2048 × 768, two
  layers: loop 14 ms, gather 74 ms, dense 306 ms; docs/benchmarks.md). Tokens that did not pick
  an expert get weight 0 in its combine column, so each token's result sums its own experts in
  ascending id order whatever N is. The loop has
  a static trip count (min(E, N·k)) so it stays reverse-differentiable; steps past the distinct
  experts skip their work under a `lax.cond`.
  """
  dt = x.dtype
  n = x.shape[0]
  num_experts = w.down.shape[0]
  combine = _combine_matrix(weights, ids, num_experts)
  used = jnp.zeros((num_experts,), bool).at[ids.reshape(-1)].set(True)
  order = jnp.argsort(~used, stable=True)  # the selected experts first, ascending
  count = jnp.sum(used)

  # float32 products, or products in dt cast up (XLA:CPU has no bf16 × bf16 → f32 dot), as Dense.
  pet = jnp.float32 if dt == jnp.float32 else None

  def matmul(a, b):
    return jnp.matmul(a, b, preferred_element_type=pet).astype(jnp.float32)

  def one_expert(e, acc):
    hs = []
    for m, b in zip(w.ins, _biases(w)):
      h = matmul(x, take(m, e, dt))
      hs.append(h if b is None else h + b[e].astype(jnp.float32))
    hmid = w.act(*hs).astype(dt)
    y = matmul(hmid, take(w.down, e, dt))
    if w.down_bias is not None:
      y = y + w.down_bias[e].astype(jnp.float32)
    return acc + combine[:, e, None] * y

  def step(i, acc):
    return jax.lax.cond(i < count, one_expert, lambda e, a: a, order[i], acc)

  steps = min(num_experts, ids.size)
  acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((n, x.shape[1]), jnp.float32))
  return acc.astype(out_dtype or dt)


EXPERT_BACKENDS = {
  "dense": experts_dense,
  "ragged": experts_ragged,
  "gather": experts_gather,
  "loop": experts_loop,
}


def local_experts(
  name: str,
  x: jax.Array,
  weights: jax.Array,
  ids: jax.Array,
  w: Experts,
  out_dtype: Any = None,
  gmm_impl: str = "auto",
) -> jax.Array:
  """Experts held on this device on their (token, expert) pairs, by the backend `name` resolves to
  (pick_backend); the per-device step of the expert-parallel backends too."""
  backend = pick_backend(name, ids.size, w.down.shape[0])
  if backend == "ragged":
    return experts_ragged(x, weights, ids, w, gmm_impl, out_dtype)
  return EXPERT_BACKENDS[backend](x, weights, ids, w, out_dtype)


def pick_backend(name: str, num_pairs: int, num_experts: int) -> str:
  """Resolves "auto": on CPU the loop at every size (measured fastest there at 1 to 64 tokens,
  and XLA:CPU lowers ragged_dot to a masked dense product); elsewhere gather when the N·k pairs
  need fewer expert reads than there are experts (decode, short verify blocks), else grouped
  matmuls."""
  if name not in ("auto", *ep.EP_BACKENDS):
    return name
  if jax.default_backend() == "cpu":
    return "loop"
  return "gather" if num_pairs <= num_experts else "ragged"


class MoE(nn.Module):
  """Routed experts (+ optional always-on shared experts)."""

  config: ModelConfig

  def _expert_param(self, name: str, axes: tuple, shape: tuple, dtype: Any) -> Any:
    return weight(self, name, nn.with_logical_partitioning(normal_init(), axes), shape, dtype)

  def _bias(self, name: str, axes: tuple, shape: tuple) -> jax.Array:
    init = nn.with_logical_partitioning(nn.initializers.zeros, axes)
    return self.param(name, init, shape, dtype_of(self.config.param_dtype))

  def experts(self) -> Experts:
    """This layer's expert weights (created at init): separate gate/up, or gpt-oss's fused,
    interleaved gate_up with biases and the clamped SwiGLU."""
    c = self.config
    pdt = dtype_of(c.param_dtype)
    e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
    if c.fused_gate_up:
      ins = (self._expert_param("gate_up_proj", ep.INS_AXES, (e, h, 2 * i), pdt),)
      act = functools.partial(clamped_swiglu, limit=c.swiglu_limit, alpha=c.swiglu_alpha)
      if c.family.fused_gate_up == "gate_then_up":
        act = split_geglu
    else:
      ins = tuple(
        self._expert_param(name, ep.INS_AXES, (e, h, i), pdt)
        for name in ("gate_proj", "up_proj")
      )
      act = swiglu
    down = self._expert_param("down_proj", ep.DOWN_AXES, (e, i, h), pdt)
    in_biases = down_bias = None
    if c.expert_bias:
      width = ins[0].shape[-1]
      names = ("gate_up_bias",) if c.fused_gate_up else ("gate_bias", "up_bias")
      in_biases = tuple(self._bias(n, ep.IN_BIAS_AXES, (e, width)) for n in names)
      down_bias = self._bias("down_bias", ep.DOWN_BIAS_AXES, (e, h))
    return Experts(ins, in_biases, down, down_bias, act)

  @nn.compact
  def __call__(self, x: jax.Array, router_input: jax.Array | None = None) -> jax.Array:
    """x [..., H] → [..., H]. The router reads `router_input` where given (Gemma 4 routes on
    the layer's un-normed residual while its experts read their own norm's output)."""
    c = self.config
    e, h = c.num_experts, c.hidden_size
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
    elif c.router == "topk_softmax":
      bias = self.param(
        "router_bias",
        nn.with_logical_partitioning(nn.initializers.zeros, (None,)),
        (e,),
        jnp.float32,
      )
    experts = self.experts()

    lead = x.shape[:-1]
    xf = x.reshape(-1, h)
    r = xf if router_input is None else router_input.reshape(-1, h)
    if c.router == "gemma4":  # RMS-normed without a scale, then a learned scale / sqrt(H)
      scale = self.param(
        "router_scale", nn.with_logical_partitioning(nn.initializers.ones, ("embed",)), (h,),
        jnp.float32,
      )
      r = rms_normalize(r, c.rms_norm_eps).astype(jnp.float32) * scale * h**-0.5
    # The router runs in float32 (HF keeps gate.weight and the bias in fp32 too).
    logits = r.astype(jnp.float32) @ materialize(router, jnp.float32)
    if c.router == "topk_softmax":
      logits = logits + bias
    weights, ids = route(c, logits, bias)
    if c.router == "gemma4":
      per_expert = self.param(
        "per_expert_scale", nn.with_logical_partitioning(nn.initializers.ones, (None,)), (e,),
        jnp.float32,
      )
      weights = weights * per_expert[ids]
    # Routing statistics (no-ops unless 'intermediates' is mutable): the raw router logits
    # [N, E] (routing margins for parity checks, router sensitivity for quantization), the
    # fraction of routed slots per expert and the mean normalised router score (load balancing).
    self.sow("intermediates", "router_logits", logits)
    self.sow(
      "intermediates",
      "expert_load",
      jnp.bincount(ids.reshape(-1), length=e).astype(jnp.float32) / ids.size,
    )
    scores = jax.nn.sigmoid(logits) if c.router == "sigmoid" else jax.nn.softmax(logits)
    self.sow(
      "intermediates", "router_score", jnp.mean(scores / jnp.sum(scores, -1, keepdims=True), axis=0)
    )
    dt = dtype_of(c.dtype)
    mesh = sharding.active_mesh()
    run_local = functools.partial(local_experts, "auto", gmm_impl=c.options.gmm_impl)
    if ep.applies(c.options.moe_backend, e, mesh):
      y, dropped = ep.experts_ep(
        xf.astype(dt),
        weights,
        ids,
        experts,
        run_local,
        mesh=mesh,
        rules=nn.get_logical_axis_rules() or None,
        backend="ep" if c.options.moe_backend == "auto" else c.options.moe_backend,
        capacity_factor=c.options.ep_capacity_factor,
        ragged_all_to_all=None if jax.default_backend() == "cpu" else jax.lax.ragged_all_to_all,
      )
      self.sow("intermediates", "ep_dropped", dropped)
    else:  # the backend pick_backend resolves (gather and loop dequantize only selected experts)
      y = local_experts(
        c.options.moe_backend, xf.astype(dt), weights, ids, experts, gmm_impl=c.options.gmm_impl
      )
    y = y.reshape(*lead, h)
    if c.n_shared_experts:
      y = y + MLP(c, c.shared_intermediate_size, name="shared_experts")(x)
    if c.shared_expert_intermediate_size:  # Qwen3-Next / Qwen3.5: sigmoid-gated shared expert
      gate = Dense(
        (1,), ("embed", None), name="shared_expert_gate", dtype=c.dtype, param_dtype=c.param_dtype
      )(x)
      shared = MLP(c, c.shared_expert_intermediate_size, name="shared_expert")(x)
      gated = jax.nn.sigmoid(gate.astype(jnp.float32)) * shared.astype(jnp.float32)
      y = y + gated.astype(y.dtype)
    return y
