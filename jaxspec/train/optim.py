"""Optimizers for training jaxspec models: AdamW or Muon, warmup + cosine decay, clipping.

Weight decay applies to matrices only (never to norms, biases or the routers' correction
biases), decided by parameter name because scanned layer stacks give a norm scale the shape
[layers, H]. `e_score_correction_bias` is frozen for the optimizer: it is moved by DeepSeek's
bias update (losses.bias_update), never by gradients.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from optax.contrib import MuonDimensionNumbers, muon

_NO_DECAY = ("scale", "bias", "e_score_correction_bias")
_FROZEN = ("e_score_correction_bias",)


def _name(path: tuple) -> tuple[str, ...]:
  return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def decay_mask(params: Any) -> Any:
  """True for the leaves that get weight decay (matrices: kernels, experts, embeddings)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: _name(p)[-1] not in _NO_DECAY, params)


def frozen_labels(params: Any) -> Any:
  """'frozen' for leaves the optimizer must not touch, 'train' for the rest."""
  return jax.tree_util.tree_map_with_path(
    lambda p, _: "frozen" if _name(p)[-1] in _FROZEN else "train", params
  )


def muon_dimensions(params: Any, stacked_prefix: str = "layers_") -> Any:
  """Muon's (reduction, output) axes per matrix leaf; None leaves go to Adam.

  Attention/MLP kernels are [(layers,) *in, *out] (o_proj contracts two axes: heads, head_dim),
  routed experts [(layers,) E, in, out]; a leading stacked-layer axis or the expert axis is a
  batch axis, orthogonalised separately. Embeddings, the LM head, routers, norms and biases use
  Adam (the usual Muon recipe).
  """

  def dims(path: tuple, leaf: Any) -> MuonDimensionNumbers | None:
    names = _name(path)
    stacked = 1 if stacked_prefix and names[0].startswith(stacked_prefix) else 0
    last = names[-1]
    if last == "kernel" and names[-2] in ("q_proj", "k_proj", "v_proj"):
      return MuonDimensionNumbers(stacked, (stacked + 1, stacked + 2))
    if last == "kernel" and names[-2] == "o_proj":
      return MuonDimensionNumbers((stacked, stacked + 1), stacked + 2)
    if last == "kernel" and names[-2] in ("gate_proj", "up_proj", "down_proj", "eh_proj", "fc"):
      return MuonDimensionNumbers(stacked, stacked + 1)
    if last in ("gate_proj", "up_proj", "down_proj") and leaf.ndim == stacked + 3:
      return MuonDimensionNumbers(stacked + 1, stacked + 2)  # routed experts [E, in, out]
    return None

  return jax.tree_util.tree_map_with_path(dims, params)


def unstacked_muon_dimensions(params: Any) -> Any:
  """Muon axes for models whose layers are separate subtrees (the drafters' `layers_i`)."""
  return muon_dimensions(params, stacked_prefix="")


def learning_rate_schedule(
  peak: float, total_steps: int, warmup_steps: int, final_fraction: float = 0.1
) -> optax.Schedule:
  """Linear warmup to `peak`, then cosine decay to `peak * final_fraction` at total_steps."""
  warmup_steps = max(1, min(warmup_steps, total_steps - 1))
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=peak,
    warmup_steps=warmup_steps,
    decay_steps=max(total_steps, warmup_steps + 1),
    end_value=peak * final_fraction,
  )


def make_optimizer(
  params: Any,
  *,
  total_steps: int,
  learning_rate: float,
  warmup_steps: int,
  final_lr_fraction: float = 0.1,
  weight_decay: float = 0.1,
  b1: float = 0.9,
  b2: float = 0.95,
  grad_clip: float = 1.0,
  name: str = "adamw",
  muon_learning_rate: float = 0.02,
  muon_dims: Callable[[Any], Any] = muon_dimensions,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """The optimizer (clip → AdamW or Muon) and its learning-rate schedule.

  Args:
    params: the parameter tree (for the frozen leaves; masks are computed from the tree the
      optimizer is initialised with).
    total_steps: length of the whole run (the cosine reaches its floor there).
    learning_rate: peak AdamW learning rate (Adam part of Muon too).
    warmup_steps: linear warmup length.
    final_lr_fraction: the floor of the cosine, as a fraction of the peak.
    weight_decay: decoupled weight decay on matrices.
    b1, b2: Adam moments.
    grad_clip: global-norm clipping threshold (0 disables).
    name: "adamw" or "muon".
    muon_learning_rate: peak learning rate of Muon's orthogonalised matrix updates.
    muon_dims: params → Muon dimension numbers per leaf (None: Adam).

  Returns:
    (optimizer, schedule): the schedule maps step → AdamW learning rate (for logging).
  """
  schedule = learning_rate_schedule(learning_rate, total_steps, warmup_steps, final_lr_fraction)
  if name == "adamw":
    inner = optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask)
  elif name == "muon":
    muon_schedule = learning_rate_schedule(
      muon_learning_rate, total_steps, warmup_steps, final_lr_fraction
    )
    inner = muon(
      muon_schedule,
      weight_decay=weight_decay,
      weight_decay_mask=decay_mask,
      adam_b1=b1,
      adam_b2=b2,
      adam_weight_decay=weight_decay,
      adam_learning_rate=schedule,
      muon_weight_dimension_numbers=muon_dims,
    )
  else:
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'muon'")
  chain = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
  chain.append(
    optax.multi_transform({"train": inner, "frozen": optax.set_to_zero()}, frozen_labels(params))
  )
  return optax.chain(*chain), schedule
