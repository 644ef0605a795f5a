"""What a forward pass costs against the memory roofline, on random weights of real shape.

Decoding a large model is memory-bound: one token's forward reads every weight once, so its
speed limit is (memory bandwidth) ÷ (bytes per token), and a verify pass of T tokens costs
about as much as one token for T up to the machine's FLOP/byte ratio. This module measures
both halves on the machine at hand:

* `reference_bandwidth`: the better of a ≥ 1 GiB streaming reduction and one large XLA
  matrix-vector product: what this backend can read per second.
* `reference_flops`: one large square matmul: what this backend can compute per second. The
  roofline of a forward is the larger of its bytes' time and its FLOPs' time
  (`roofline_seconds`); their ratio at T = 1 is the machine's ridge point, the T beyond which
  a verify block costs more than one token.
* `cost_curve`: one target forward of T = 1, 2, 4, … tokens at a mid-cache position, timed
  (median of repeats) with the decoding state donated as in decoding.
* `weight_bytes_read`: the bytes a forward of T tokens must read (all dense weights, the LM
  head, T embedding rows, the experts its tokens route to, the KV prefix), for the roofline %;
  `forward_flops`: the multiply-adds it must do (every weight once per token, a token's own
  experts, attention over its prefix).
* `project_speedup`: τ · t(1) / (t_verify + t_draft), the speculative speedup these costs imply
  for an acceptance length τ.

Weights' values do not change a forward's cost, so the models are random (`random_params`
draws them on the device, leaf by leaf, without a host copy); their shapes are the published
proportions (`dense_config`, `moe_config`). `launch/bench.py cost-curve` prints and plots
these numbers, and `launch/bench.py device` runs them on an accelerator.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.options import RunOptions
from jaxspec.models import target as target_lib
from jaxspec.plan import decoding_state_bytes
from jaxspec.state import DecodingState

GIB = 1 << 30


# -- model shapes -----------------------------------------------------------------------------------


def dense_config(
  hidden: int = 2048,
  layers: int = 4,
  intermediate: Optional[int] = None,
  vocab: int = 32768,
  head_dim: int = 128,
  kv_heads: int = 4,
  dtype: str = "float32",
) -> ModelConfig:
  """A Qwen3-shaped dense model (intermediate = 4 × hidden, 128-wide heads, GQA)."""
  return ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=vocab,
    hidden_size=hidden,
    num_layers=layers,
    num_heads=hidden // head_dim,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    intermediate_size=intermediate or 4 * hidden,
    options=RunOptions(dtype=dtype, param_dtype=dtype),
  )


def moe_config(
  hidden: int = 2048,
  layers: int = 4,
  experts: int = 64,
  experts_per_tok: int = 8,
  expert_intermediate: int = 768,
  vocab: int = 32768,
  head_dim: int = 128,
  kv_heads: int = 4,
  dtype: str = "float32",
) -> ModelConfig:
  """A Qwen3-MoE-shaped model (every layer sparse, softmax top-k router)."""
  return ModelConfig(
    architecture="Qwen3MoeForCausalLM",
    vocab_size=vocab,
    hidden_size=hidden,
    num_layers=layers,
    num_heads=hidden // head_dim,
    num_kv_heads=kv_heads,
    head_dim=head_dim,
    intermediate_size=expert_intermediate,
    num_experts=experts,
    num_experts_per_tok=experts_per_tok,
    moe_intermediate_size=expert_intermediate,
    norm_topk_prob=True,
    options=RunOptions(dtype=dtype, param_dtype=dtype),
  )


def random_params(config: ModelConfig, seed: int = 0, stddev: float = 0.02) -> Any:
  """Random parameters of `config`'s shapes drawn on the default device (norm scales 1)."""
  shapes = target_lib.param_shapes(config)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

  @jax.jit
  def draw(key):
    out = []
    for i, (path, s) in enumerate(leaves):
      if "norm" in jax.tree_util.keystr(path) and len(s.shape) <= 2:
        out.append(jnp.ones(s.shape, s.dtype))
      else:
        k = jax.random.fold_in(key, i)
        out.append((stddev * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype))
    return out

  return jax.tree_util.tree_unflatten(treedef, draw(jax.random.PRNGKey(seed)))


# -- what must be read ---------------------------------------------------------------------------


def _sum_by_role(params: Any, measure: Callable[[Any], int]) -> dict[str, int]:
  """`measure` of each weight (array or QTensor) summed per role (jaxspec.quant.policy.role_of)."""
  from jaxspec.quant.formats import QTensor  # pylint: disable=import-outside-toplevel
  from jaxspec.quant.policy import path_str, role_of  # pylint: disable=import-outside-toplevel

  out: dict[str, int] = {}
  is_q = lambda x: isinstance(x, QTensor)
  for path, leaf in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]:
    role = role_of(path_str(path))
    out[role] = out.get(role, 0) + measure(leaf)
  return out


def _bytes_by_role(params: Any) -> dict[str, int]:
  """Stored bytes of a parameter tree per weight role, quantized weights counted as stored."""
  from jaxspec.quant.formats import nbytes  # pylint: disable=import-outside-toplevel

  return _sum_by_role(params, nbytes)


def expected_distinct_experts(num_experts: int, k: int, tokens: int) -> float:
  """Expected number of distinct experts T tokens route to (each picks k of E uniformly)."""
  return num_experts * (1.0 - (1.0 - k / num_experts) ** tokens)


def tree_bytes_stored(params: Any) -> int:
  """Stored bytes of all weights (quantized ones as stored)."""
  return sum(_bytes_by_role(params).values())


def weight_bytes_read(config: ModelConfig, params: Any, tokens: int = 1) -> float:
  """Bytes of weights a forward of `tokens` tokens must read (its memory-roofline numerator).

  Everything but the embedding table and the MTP layers, plus `tokens` embedding rows; for
  MoE layers only the experts the tokens route to (expected count under uniform routing).
  """
  by_role = _bytes_by_role(params)
  embed = by_role.pop("embed", 0)
  by_role.pop("mtp", None)
  experts = by_role.pop("experts", 0)
  row = embed / config.vocab_size
  total = sum(by_role.values()) + tokens * row
  if config.tie_word_embeddings:  # the table is also the LM head: read whole
    total += embed
  if experts:
    active = expected_distinct_experts(config.num_experts, config.num_experts_per_tok, tokens)
    total += experts * active / config.num_experts
  return total


def forward_flops(config: ModelConfig, params: Any, tokens: int = 1, position: int = 0) -> float:
  """FLOPs a forward of `tokens` tokens after `position` cached ones must do (its compute-roofline
  numerator): 2 per weight element per token (the embedding is a lookup, the MTP layers are not
  run, a token multiplies only its own k experts), plus QKᵀ and PV of every full-attention
  layer over each token's prefix (sliding windows ignored: an upper bound there). Norms,
  activations, routing and the linear-attention recurrences are left out (O(hidden) per
  token, against O(hidden²) for the products)."""
  by_role = _sum_by_role(params, lambda w: math.prod(w.shape))  # quantized: logical shape
  embed = by_role.pop("embed", 0)
  by_role.pop("mtp", None)
  experts = by_role.pop("experts", 0)
  per_token = sum(by_role.values())
  if config.tie_word_embeddings:
    per_token += embed
  if experts:
    per_token += experts * config.num_experts_per_tok / config.num_experts
  attention_layers = sum(not config.is_linear(i) for i in range(config.num_layers))
  prefix = tokens * position + tokens * (tokens + 1) / 2  # Σ over the tokens of their context
  attention = 4 * prefix * config.num_heads * config.head_dim * attention_layers
  return 2.0 * tokens * per_token + attention


def kv_bytes_read(config: ModelConfig, position: int, batch: int = 1, kv_format: str = "float"):
  """Bytes of the decoding state a forward at `position` reads (the committed prefix)."""
  return decoding_state_bytes(config, batch, position, kv_format) if position else 0


# -- timing --------------------------------------------------------------------------------------


def median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
  """Median wall time of `fn()` (blocked until ready) over `repeats` runs after `warmup`."""
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def reference_bandwidth(nbytes: int = GIB, repeats: int = 5) -> dict[str, float]:
  """Bytes per second this backend reads: a streaming sum and one large matvec (float32).

  Returns {"stream": B/s, "matvec": B/s, "best": B/s}.
  """
  n = max(nbytes // 4, 1 << 20)
  big = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32))(jax.random.PRNGKey(0))
  stream = 4 * n / median_seconds(functools.partial(jax.jit(jnp.sum), big), repeats)
  big.delete()
  cols = 8192
  rows = max(n // cols, 1)
  w = jax.jit(lambda k: jax.random.normal(k, (rows, cols), jnp.float32))(jax.random.PRNGKey(1))
  x = jnp.ones((1, rows), jnp.float32)
  matvec = functools.partial(jax.jit(jnp.matmul), x, w)
  mv = 4 * rows * cols / median_seconds(matvec, repeats)
  w.delete()
  return {"stream": stream, "matvec": mv, "best": max(stream, mv)}


def reference_flops(size: int = 2048, repeats: int = 5, dtype: Any = jnp.float32) -> float:
  """FLOP/s of one [size, size] × [size, size] matmul: the compute ceiling of the roofline."""
  a = jax.jit(lambda k: jax.random.normal(k, (size, size), jnp.float32).astype(dtype))(
    jax.random.PRNGKey(2)
  )
  matmul = jax.jit(lambda x: jnp.matmul(x, x, preferred_element_type=jnp.float32))
  seconds = median_seconds(functools.partial(matmul, a), repeats)
  return 2.0 * size**3 / seconds


@dataclasses.dataclass(frozen=True)
class CostPoint:
  """One timed forward: its tokens, median seconds, and the weight bytes and FLOPs it needs."""

  tokens: int
  seconds: float
  weight_bytes: float
  flops: float = 0.0


def roofline_seconds(point: CostPoint, bandwidth: float, flops_per_s: float = 0.0) -> float:
  """The least time `point`'s forward can take: its weight bytes at `bandwidth`, or its FLOPs
  at `flops_per_s` if that is longer (0: no compute ceiling)."""
  compute = point.flops / flops_per_s if flops_per_s > 0 else 0.0
  return max(point.weight_bytes / bandwidth, compute)


def cost_curve(
  config: ModelConfig,
  params: Any,
  tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
  max_len: int = 1024,
  position: Optional[int] = None,
  repeats: int = 5,
  batch: int = 1,
) -> list[CostPoint]:
  """Median time of one jitted target forward of T tokens at `position` (default max_len / 2)."""
  position = max_len // 2 if position is None else position
  if position + max(tokens) > max_len:
    raise ValueError(f"position {position} + {max(tokens)} tokens exceeds max_len {max_len}")
  points = []
  state = DecodingState.create(config, batch, max_len).with_lengths(
    jnp.full((batch,), position, jnp.int32)
  )
  start = jnp.full((batch,), position, jnp.int32)
  for t in tokens:
    ids = jnp.ones((batch, t), jnp.int32)
    holder = {"state": state}

    def run():
      out = target_lib.forward(config, params, ids, start, holder["state"])
      holder["state"] = out.state
      return out.logits

    seconds = median_seconds(run, repeats)
    state = holder["state"]
    points.append(
      CostPoint(
        t,
        seconds,
        weight_bytes_read(config, params, t * batch),
        batch * forward_flops(config, params, t, position),
      )
    )
  return points


def project_speedup(tau: float, t_plain: float, t_verify: float, t_draft: float) -> float:
  """Speculative speedup over plain decoding: τ tokens per (verify + draft) vs one per t_plain."""
  return tau * t_plain / (t_verify + t_draft)


def interpolate(points: Sequence[CostPoint], tokens: int) -> float:
  """Seconds for `tokens` tokens, log-linear between measured points (clamped at the ends)."""
  xs = [p.tokens for p in points]
  ys = [p.seconds for p in points]
  if tokens <= xs[0]:
    return ys[0]
  if tokens >= xs[-1]:
    return ys[-1] * tokens / xs[-1] if tokens > xs[-1] else ys[-1]
  lx = [math.log(x) for x in xs]
  return float(np.interp(math.log(tokens), lx, ys))


# -- drafters at the target's scale --------------------------------------------------------------


def random_drafter(method: str, target: Any, gamma: int, layers: int = 1, seed: int = 0) -> Any:
  """A random drafter of the published proportions for `target` (a TargetModel).

  "dflash": the target's width, `layers` layers (published drafters use about one per 4–8
  target layers), a block of γ + 1. "eagle3": one layer at the target's width with a 32K
  draft vocabulary (SpecForge's default), γ chained steps.
  """
  from jaxspec.drafters import dflash, eagle3  # pylint: disable=import-outside-toplevel

  tc = target.config
  if method == "dflash":
    ids = tuple(
      sorted({max(0, (i + 1) * tc.num_layers // (layers + 1) - 1) for i in range(layers)})
    )
    return dflash.DFlashDrafter.random(
      target,
      mask_token_id=0,
      num_layers=layers,
      block_size=gamma + 1,
      target_layer_ids=ids,
      seed=seed,
    )
  if method == "eagle3":
    vocab = min(tc.vocab_size, 32000)
    n = tc.num_layers  # EAGLE-3 taps the inputs of layers 2, L//2, L−3 (as outputs 1, …)
    ids = (min(1, n - 1), min(n // 2, n - 1), max(n - 3, 0))
    return eagle3.Eagle3Drafter.random(
      target, draft_vocab=np.arange(vocab), target_layer_ids=ids, gamma=gamma, seed=seed
    )
  raise ValueError(f"no random drafter for method {method!r}")


def drafter_step_seconds(
  drafter: Any, hidden_size: int, max_len: int, position: int, repeats: int = 5, batch: int = 1
) -> float:
  """Median time of one drafter step (propose, then commit of a fully accepted block)."""
  from jaxspec.drafters.base import CommitContext, ProposeContext  # pylint: disable=import-outside-toplevel
  from jaxspec import sampling  # pylint: disable=import-outside-toplevel

  params = drafter.params
  g = drafter.gamma
  tokens = jnp.ones((batch, max_len), jnp.int32)
  seq_len = jnp.full((batch,), position, jnp.int32)
  propose_ctx = ProposeContext(
    tokens, seq_len, sampling.make_sampling_params(batch), jax.random.PRNGKey(0)
  )
  n_taps = len(drafter.taps)
  commit_ctx = CommitContext(
    tokens,
    seq_len,
    jnp.full((batch,), g, jnp.int32),
    seq_len + g + 1,
    jnp.zeros((n_taps, batch, g + 1, hidden_size), jnp.float32) if n_taps else None,
    jnp.zeros((batch, g + 1, hidden_size), jnp.float32),
  )

  @jax.jit
  def step(params, state):
    proposal, state = drafter.propose(params, state, propose_ctx)
    return proposal.tokens, drafter.commit(params, state, commit_ctx)

  holder = {"state": drafter.init_state(params, batch, max_len)}

  def run():
    toks, holder["state"] = step(params, holder["state"])
    return toks

  return median_seconds(run, repeats)


# -- the report ----------------------------------------------------------------------------------


def curve_table(
  name: str, points: Sequence[CostPoint], bandwidth: float, flops_per_s: float = 0.0
) -> list[str]:
  """Rows: T, ms, t(T)/t(1), weight GB/s, bandwidth %, t(T) against the byte time; with a
  compute ceiling also GFLOP/s, the FLOPs' time against the byte time (> 1: compute-bound
  even at the ceiling) and t(T) against the roofline, the larger of the two."""
  head = f"{name}: weights read at T=1 {points[0].weight_bytes / 1e9:.2f} GB; reference bandwidth "
  head += f"{bandwidth / 1e9:.1f} GB/s"
  cols = f"{'T':>4}{'ms':>10}{'t(T)/t(1)':>11}{'GB/s':>8}{'roofline':>10}{'t/bytes':>9}"
  if flops_per_s:
    head += f", compute ceiling {flops_per_s / 1e9:.0f} GFLOP/s"
    cols += f"{'GFLOP/s':>9}{'flops/bytes':>13}{'t/roofline':>12}"
  lines = [head, cols]
  for p in points:
    byte_time = p.weight_bytes / bandwidth
    row = (
      f"{p.tokens:>4}{p.seconds * 1e3:>10.1f}{p.seconds / points[0].seconds:>11.2f}"
      f"{p.weight_bytes / p.seconds / 1e9:>8.1f}{100 * byte_time / p.seconds:>9.0f}%"
      f"{p.seconds / byte_time:>9.2f}"
    )
    if flops_per_s:
      row += f"{p.flops / p.seconds / 1e9:>9.1f}{p.flops / flops_per_s / byte_time:>13.2f}"
      row += f"{p.seconds / roofline_seconds(p, bandwidth, flops_per_s):>12.2f}"
    lines.append(row)
  return lines

