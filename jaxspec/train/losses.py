"""Training losses of a target (or draft) model: next-token, MTP and expert load balancing.

One forward of the main stack over a packed window gives the next-token loss; each MTP layer k
then reads the main model's final-normed hidden h_i beside token t_{i+1+k} and predicts
t_{i+2+k} (DeepSeek-V3 / MiMo joint training: loss = main + mtp_weight × mean of MTP losses).
MoE layers sow their routing statistics; they feed an optional switch-style auxiliary loss and
DeepSeek's auxiliary-loss-free bias update (`bias_update`, applied outside the gradient).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.models.decoder import Decoder


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean token cross-entropy (nats) of float logits [..., V] against int targets [...]."""
  logits = logits.astype(jnp.float32)
  logz = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  return jnp.mean(logz - picked)


def _routing_stats(intermediates: Any) -> list[tuple[tuple[str, ...], jax.Array, jax.Array]]:
  """(path of the MoE module, expert_load [..., E], router_score [..., E]) for each MoE site."""
  out = []

  def walk(tree: Any, path: tuple[str, ...]) -> None:
    if not isinstance(tree, dict):
      return
    if "expert_load" in tree:
      load = jnp.stack(tree["expert_load"]).mean(axis=0)
      score = jnp.stack(tree["router_score"]).mean(axis=0)
      out.append((path, load, score))
    for key in sorted(tree):
      walk(tree[key], path + (key,))

  walk(jax.tree_util.tree_map(lambda x: x, dict(intermediates)), ())
  return out


def lm_losses(
  config: ModelConfig,
  params: Any,
  batch: jax.Array,
  *,
  mtp_weight: float = 0.3,
  aux_weight: float = 0.0,
) -> tuple[jax.Array, dict[str, Any]]:
  """The training objective on one batch of packed windows.

  Args:
    config: the model architecture.
    params: the parameter tree.
    batch: int32 [B, T + 1] windows (inputs = batch[:, :-1], targets = batch[:, 1:]).
    mtp_weight: weight of the mean MTP loss (0.3 in DeepSeek-V3's early training).
    aux_weight: weight of the switch-style load-balancing loss E · Σ_e load_e · score_e,
      averaged over MoE sites (0 disables it).

  Returns:
    (total loss, aux) where aux holds the scalar metrics ("loss", "lm_loss", "mtp_loss_{k}",
    "aux_loss") and "expert_load": {module path: load [..., E]} for the bias update.
  """
  b, t1 = batch.shape
  t = t1 - 1
  inputs, targets = batch[:, :-1], batch[:, 1:]
  model = Decoder(config)
  start = jnp.zeros((b,), jnp.int32)
  out, state = model.apply({"params": params}, inputs, start, mutable=["intermediates"])
  lm_loss = cross_entropy(out.logits, targets)
  metrics: dict[str, Any] = {"lm_loss": lm_loss}
  total = lm_loss
  stats = _routing_stats(state.get("intermediates", {}))

  hidden = out.hidden
  mtp_losses = []
  for k in range(config.num_mtp_layers):
    # Depth k: hidden h_i (of the main model, or of MTP depth k-1) beside token t_{i+1+k},
    # predicting t_{i+2+k}; the window shrinks by one per depth.
    n = t - 1 - k
    (logits, h_next, _), mstate = model.apply(
      {"params": params},
      k,
      batch[:, k + 1 : k + 1 + n],
      hidden[:, :n],
      start,
      method=Decoder.mtp_forward,
      mutable=["intermediates"],
    )
    loss_k = cross_entropy(logits, batch[:, k + 2 : k + 2 + n])
    metrics[f"mtp_loss_{k}"] = loss_k
    mtp_losses.append(loss_k)
    stats += _routing_stats(mstate.get("intermediates", {}))
    # The next depth chains on this depth's output (DeepSeek-V3 sequential MTP).
    hidden = h_next
  if mtp_losses:
    total = total + mtp_weight * jnp.mean(jnp.stack(mtp_losses))

  aux_loss = jnp.float32(0.0)
  if stats:
    e = config.num_experts
    aux_loss = jnp.mean(
      jnp.stack(
        [e * jnp.mean(jnp.sum(jax.lax.stop_gradient(load) * score, -1)) for _, load, score in stats]
      )
    )
    if aux_weight:
      total = total + aux_weight * aux_loss
  metrics["aux_loss"] = aux_loss
  metrics["loss"] = total
  metrics["expert_load"] = {"/".join(path): jax.lax.stop_gradient(load) for path, load, _ in stats}
  return total, metrics


def max_violation(load: jax.Array) -> jax.Array:
  """Load imbalance of one MoE site: max_e load_e / mean load − 1 (0 when balanced)."""
  mean = jnp.mean(load, axis=-1, keepdims=True)
  return jnp.mean(jnp.max(load, axis=-1) / jnp.squeeze(mean, -1) - 1.0)


def bias_update(params: Any, expert_load: dict[str, jax.Array], rate: float) -> Any:
  """DeepSeek-V3's auxiliary-loss-free balancing: e_bias += rate · sign(mean load − load).

  Applied to every MoE module's `e_score_correction_bias` after the optimizer step (the bias
  only steers the top-k choice, so it gets no gradient). `expert_load` maps the module path
  ('layers_1/mlp', 'mtp_0/block/mlp') to the fraction of routed slots per expert.
  """
  if not rate or not expert_load:
    return params
  params = jax.tree_util.tree_map(lambda x: x, params)  # shallow copies of the dicts

  def set_in(tree: dict, path: list[str], fn) -> dict:
    tree = dict(tree)
    if len(path) == 1:
      tree[path[0]] = fn(tree[path[0]])
    else:
      tree[path[0]] = set_in(tree[path[0]], path[1:], fn)
    return tree

  for path, load in expert_load.items():
    keys = path.split("/") + ["e_score_correction_bias"]
    mean = jnp.mean(load, axis=-1, keepdims=True)
    delta = rate * jnp.sign(mean - load)
    params = set_in(params, keys, lambda b, d=delta: b + d.astype(b.dtype))
  return params
