"""Trains feature-conditioned drafters (DFlash, EAGLE-3) against a frozen target.

Each step runs the frozen target over a batch of self-distillation sequences
(`jaxspec.train.distill`) to produce the drafter's features (and, for EAGLE-3, the target's
logits) on the fly, then updates only the drafter's own weights: the target's embedding and LM
head, which the drafters share, stay frozen and outside the optimizer. The objectives are those
of `jaxspec.train.drafter_losses`. The update is one jitted function of an explicit state
{step, params, opt_state, best_val, bad_evals} (donated); random anchors come from
`fold_in(seed, step)`, and batch s is `DistillDataset.batch_at(s)`, so a run killed at any
moment resumes from its last orbax checkpoint to the parameters of an uninterrupted run. The
loop, metrics and checkpoints are the target trainer's (`trainer.run_loop`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from jaxspec.drafters.base import Drafter
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.errors import ConfigError
from jaxspec.models.target import TargetModel
from jaxspec.train import distill, drafter_losses, optim, target_cache, trainer

METHODS = ("dflash", "eagle3")


@dataclasses.dataclass(frozen=True)
class DrafterTrainConfig:
  """Hyper-parameters of a drafter run (the `train` section of a drafter config)."""

  batch_size: int = 16
  num_epochs: float = 1.0
  num_steps: int = 0  # > 0 overrides num_epochs
  learning_rate: float = 1e-3  # AdamW (and the Adam part of Muon)
  muon_learning_rate: float = 0.02
  optimizer: str = "muon"
  warmup_steps: int = 100
  final_lr_fraction: float = 0.1
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  # DFlash
  num_anchors: int = 64  # random blocks per sequence (the reference uses up to 512 per 3-4K)
  loss_decay: float = 7.0  # slot k ≥ 1 weighs exp(−(k−1)/loss_decay)
  # Weight of the soft cross-entropy against the target's distribution (T = 1) in each slot's
  # loss, the rest on the sampled token: 0 = hard labels only (the published recipe).
  soft_label_weight: float = 0.0
  # EAGLE-3
  ttt_steps: int = 7
  ttt_decay: float = 0.8
  seed: int = 0
  data_seed: int = 0
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  eval_every: int = 0  # 0: once per epoch (and at the end)
  eval_batches: int = 0  # 0: all validation batches
  patience: int = 0
  log_every: int = 10
  step_delay_s: float = 0.0

  def __post_init__(self):
    if not 0.0 <= self.soft_label_weight <= 1.0:
      raise ConfigError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")

  @classmethod
  def from_mapping(cls, m: Mapping[str, Any]) -> "DrafterTrainConfig":
    return trainer.dataclass_from_mapping(cls, m, "drafter train config")


def method_of(drafter: Drafter) -> str:
  if isinstance(drafter, DFlashDrafter):
    return "dflash"
  if isinstance(drafter, Eagle3Drafter):
    return "eagle3"
  raise TypeError(f"no training objective for {type(drafter).__name__}; expected {METHODS}")


def init_drafter(
  method: str, target: TargetModel, spec: Mapping[str, Any], vocab_counts: Any = None
) -> Drafter:
  """A freshly initialised drafter for `target` from a config's `drafter` section `spec`
  (target_layer_ids, num_heads, num_kv_heads, head_dim, intermediate_size, seed; DFlash:
  num_layers, block_size and, for a tokenizer without a mask token, mask_token_id; both:
  draft_vocab_size, the `draft_vocab_size` most frequent tokens of `vocab_counts`).

  Initialised from the target where shapes allow (as the reference recipes do): the output
  norm from the target's final norm; EAGLE-3's own LM head from the target's (tied) head rows
  of its draft vocabulary (DFlash scores its draft vocabulary with the target's own rows).
  """
  d = ml_collections.ConfigDict(dict(spec))
  vocab = None
  size = d.get("draft_vocab_size", 0)
  if 0 < size < target.config.vocab_size:
    if vocab_counts is None:
      raise ConfigError(f"a reduced {method} draft vocabulary needs token counts")
    vocab = np.sort(np.argsort(-np.asarray(vocab_counts), kind="stable")[:size])
  common = dict(
    target_layer_ids=tuple(d.target_layer_ids),
    num_heads=d.num_heads,
    num_kv_heads=d.num_kv_heads,
    head_dim=d.head_dim,
    intermediate_size=d.intermediate_size,
    seed=d.seed,
  )
  if method == "dflash":
    drafter = DFlashDrafter.random(
      target,
      num_layers=d.num_layers,
      block_size=d.block_size,
      mask_token_id=d.get("mask_token_id"),
      draft_vocab=vocab,
      **common,
    )
  elif method == "eagle3":
    drafter = Eagle3Drafter.random(target, draft_vocab=vocab, **common)
  else:
    raise ConfigError(f"unknown drafter method {method!r}; expected dflash or eagle3")
  draft = dict(drafter.params["draft"])
  draft["norm"] = {"scale": jnp.asarray(target.params["norm"]["scale"])}
  if method == "eagle3":
    head = target.params.get("lm_head", {}).get("kernel")
    head = head if head is not None else jnp.asarray(target.params["embed"]).T
    ids = np.arange(drafter.config.draft_vocab_size)
    if drafter.config.reduced_vocab:
      ids = ids + np.asarray(drafter.params["d2t"])
    draft["lm_head"] = {"kernel": jnp.asarray(head)[:, ids]}
  return dataclasses.replace(drafter, params=dict(drafter.params, draft=draft))


def warm_start(fresh: Drafter, init: Drafter) -> Drafter:
  """`init`'s weights (and, for EAGLE-3, its draft vocabulary) under `fresh`'s taps.

  Continues training a drafter, e.g. one whose target features changed meaning; the two must
  have the same architecture (parameter names and shapes), else a ConfigError names the first
  difference. A DFlash drafter may also grow deeper: `fresh` with more layers than `init`
  (`grow_dflash`).
  """
  if type(init) is not type(fresh):
    raise ConfigError(f"cannot warm-start a {type(fresh).__name__} from a {type(init).__name__}")
  if isinstance(fresh, DFlashDrafter) and fresh.config.num_layers > init.config.num_layers:
    init = grow_dflash(init, fresh)
  # A DFlash drafter's draft vocabulary is the target's head rows, not weights: fresh's is kept.
  vocab_keys = ("draft_vocab", "draft_head") if isinstance(fresh, DFlashDrafter) else ()
  want = {jax.tree_util.keystr(k): v.shape for k, v in _leaves(_without(fresh.params, vocab_keys))}
  have = {jax.tree_util.keystr(k): v.shape for k, v in _leaves(_without(init.params, vocab_keys))}
  for name in sorted(set(want) | set(have)):
    if want.get(name) != have.get(name):
      raise ConfigError(
        f"warm start: parameter {name} is {have.get(name)} in the initial drafter, "
        f"{want.get(name)} in the configured one"
      )
  changes: dict[str, Any] = {"target_layer_ids": fresh.config.target_layer_ids}
  params = init.params
  if vocab_keys:
    changes["draft_vocab_size"] = fresh.config.draft_vocab_size
    params = {**_without(init.params, vocab_keys), **{
      k: fresh.params[k] for k in vocab_keys if k in fresh.params
    }}
  return dataclasses.replace(
    init, params=params, config=dataclasses.replace(init.config, **changes)
  )


def _without(params: dict, keys: tuple[str, ...]) -> dict:
  return {k: v for k, v in params.items() if k not in keys}


def grow_dflash(init: DFlashDrafter, fresh: DFlashDrafter) -> DFlashDrafter:
  """`init` deepened to `fresh`'s layer count, computing exactly what `init` computes.

  The layers of `init` keep their weights and order; each added layer (appended before the
  final norm) takes `fresh`'s random weights except its attention output and MLP down
  projections, which start at zero, so it adds nothing to the residual stream until training
  moves them (function-preserving growth). The added layers' context K/V come from the same
  fused features as the others'.
  """
  n_old, n_new = init.config.num_layers, fresh.config.num_layers
  draft = dict(init.params["draft"])
  for i in range(n_old, n_new):
    layer = fresh.params["draft"][f"layers_{i}"]
    attn = dict(layer["self_attn"])
    attn["o_proj"] = jax.tree_util.tree_map(jnp.zeros_like, attn["o_proj"])
    mlp = dict(layer["mlp"])
    mlp["down_proj"] = jax.tree_util.tree_map(jnp.zeros_like, mlp["down_proj"])
    draft[f"layers_{i}"] = dict(layer, self_attn=attn, mlp=mlp)
  windows = init.config.layer_windows + fresh.config.layer_windows[n_old:n_new]
  config = init.config.replace(num_layers=n_new, layer_windows=windows)
  hf = dict(init.hf_config or {}, max_window_layers=n_new)
  return dataclasses.replace(
    init, config=config, params=dict(init.params, draft=draft), hf_config=hf
  )


def _leaves(tree: Any) -> list:
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def make_loss_fn(
  drafter: Drafter,
  target: TargetModel,
  tc: DrafterTrainConfig,
  evaluation: bool = False,
  cache_taps: tuple[int, ...] | None = None,
) -> Callable:
  """(draft_params, frozen, batch, key) → (loss, metrics); frozen = {"target", "shared"}.

  `evaluation` adds the metrics too costly for every step (DFlash's draft/target overlap).
  With `cache_taps` (the layers a `target_cache` stores) the batches carry the target's
  outputs ("taps", "top_ids", "top_logp") and the target is not run: its soft labels are then
  its top-k distribution.
  """
  tap_index = None
  if cache_taps is not None:
    tap_index = jnp.asarray(target_cache.tap_positions(cache_taps, drafter.taps))
  method = method_of(drafter)
  tconfig = target_cache.full_sequence_config(target.config)

  soft = method == "dflash" and (tc.soft_label_weight > 0 or evaluation)

  def loss_fn(draft_params, frozen, batch, key):
    params = dict(frozen["shared"], draft=draft_params)
    tokens, mask = batch["tokens"], batch["loss_mask"]
    top = None
    if tap_index is not None:
      taps = jnp.moveaxis(jnp.take(batch["taps"], tap_index, axis=1), 1, 0)  # [n, B, S, H]
      taps = taps.astype(drafter.config.dtype)
      logits, top = None, (batch["top_ids"], batch["top_logp"])
    else:
      taps, logits = target_cache.target_features(
        tconfig, frozen["target"], tokens, drafter.taps, logits=method == "eagle3" or soft
      )
    if method == "dflash":
      return drafter_losses.dflash_loss(
        drafter,
        params,
        tokens,
        taps,
        mask,
        key,
        num_anchors=tc.num_anchors,
        gamma=tc.loss_decay,
        target_logits=logits if soft else None,
        soft_weight=tc.soft_label_weight,
        with_overlap=evaluation,
        target_top=top if soft else None,
      )
    return drafter_losses.eagle3_ttt_loss(
      drafter,
      params,
      tokens,
      taps,
      logits,
      mask,
      steps=tc.ttt_steps,
      decay=tc.ttt_decay,
      target_top=top,
    )

  return loss_fn


def frozen_inputs(drafter: Drafter, target: TargetModel) -> dict[str, Any]:
  """What the step reads but never updates: the target and the drafter's shared tensors."""
  return {
    "target": target.params,
    "shared": {k: v for k, v in drafter.params.items() if k != "draft"},
  }


def init_state(
  drafter: Drafter, tc: DrafterTrainConfig, total_steps: int
) -> tuple[dict[str, Any], optax.GradientTransformation, optax.Schedule]:
  """Training state over the drafter's own weights (params["draft"]) and its optimizer."""
  # A copy: the step donates the state, and the drafter's arrays may alias the target's.
  params = jax.tree_util.tree_map(jnp.copy, drafter.params["draft"])
  return trainer.new_state(params, tc, total_steps, optim.unstacked_muon_dimensions)


def make_train_step(
  loss_fn: Callable, tc: DrafterTrainConfig, opt: optax.GradientTransformation, schedule
) -> Callable:
  """Jitted (state, frozen, batch) → (state, metrics); the state is donated."""

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, frozen, batch):
    key = jax.random.fold_in(jax.random.PRNGKey(tc.seed), state["step"])
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      state["params"], frozen, batch, key
    )
    updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = dict(metrics, grad_norm=optax.tree.norm(grads), lr=schedule(state["step"]))
    return dict(state, step=state["step"] + 1, params=params, opt_state=opt_state), metrics

  return step


def make_eval_fn(
  loss_fn: Callable, frozen: Any, dataset: distill.DistillDataset, max_batches: int, seed: int
) -> Callable[[Any], dict[str, float]]:
  """params → mean validation metrics over the dataset (fixed anchors: comparable evals).

  A dataset of several sampling temperatures is also scored per temperature ("T=0/accept_len",
  "T=1/overlap", ...): a drafter's blocks on greedy continuations run long and on sampled ones
  rarely, which one mean hides. Wherever passes_per_token is measured, "tau" = its inverse,
  the estimate of decoding's pooled acceptance length.
  """
  step = jax.jit(lambda p, f, b, k: loss_fn(p, f, b, k)[1])
  parts = dataset.by_temperature()
  if len(parts) < 2:
    parts = {None: dataset}

  def evaluate_part(params, part, first):
    n = part.batches_per_epoch
    n = n if max_batches <= 0 else min(max_batches, n)

    def metrics_at(i):  # anchors keyed by the batch's place in the whole set
      batch = {k: jnp.asarray(v) for k, v in part.batch_at(i).items()}
      key = jax.random.fold_in(jax.random.PRNGKey(seed + 1), first + i)
      return step(params, frozen, batch, key)

    return trainer.mean_metrics(metrics_at, n), n

  def with_tau(m):
    if m.get("passes_per_token"):
      m["tau"] = 1.0 / m["passes_per_token"]
    return m

  def evaluate(params):
    results, first = {}, 0
    for t, part in parts.items():
      results[t] = evaluate_part(params, part, first)
      first += part.batches_per_epoch
    total = sum(n for _, n in results.values())
    out = {
      k: sum(m[k] * n for m, n in results.values()) / total for k in next(iter(results.values()))[0]
    }
    out = with_tau(out)
    for t, (m, _) in results.items():
      if t is not None:
        out.update({f"T={t:g}/{k}": v for k, v in with_tau(dict(m)).items()})
    return out

  return evaluate


def train(
  drafter: Drafter,
  target: TargetModel,
  tc: DrafterTrainConfig,
  train_data: distill.DistillDataset,
  val_data: distill.DistillDataset | None,
  workdir: str,
  progress: bool = True,
) -> tuple[Drafter, trainer.TrainResult]:
  """Trains (or resumes training) `drafter`'s own weights; returns the trained drafter."""
  per_epoch = train_data.batches_per_epoch
  total = tc.num_steps if tc.num_steps > 0 else max(1, int(round(tc.num_epochs * per_epoch)))
  eval_every = tc.eval_every if tc.eval_every > 0 else per_epoch
  state, opt, schedule = init_state(drafter, tc, total)
  manager = trainer.checkpoint_manager(workdir, tc.keep_checkpoints)
  state, restored = trainer.restore_latest(manager, state)
  start = 0 if restored is None else int(state["step"])
  if restored is not None:
    logging.info("resumed from checkpoint at step %d", start)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(state["params"]))
  logging.info(
    "%s drafter: %d trainable params; %d steps (%d per epoch of %d supervised tokens)",
    method_of(drafter),
    n_params,
    total,
    per_epoch,
    train_data.num_supervised,
  )
  cache_taps = train_data.cache.taps if train_data.cache is not None else None
  if val_data is not None and (val_data.cache is None) != (cache_taps is None):
    raise ConfigError("the training and validation sets must both carry a target cache, or neither")
  loss_fn = make_loss_fn(drafter, target, tc, cache_taps=cache_taps)
  frozen = frozen_inputs(drafter, target)
  step_fn = make_train_step(loss_fn, tc, opt, schedule)
  if val_data is not None:
    eval_loss = make_loss_fn(drafter, target, tc, evaluation=True, cache_taps=cache_taps)
    eval_fn = make_eval_fn(eval_loss, frozen, val_data, tc.eval_batches, tc.seed)
  else:
    eval_fn = lambda params: {"loss": math.nan}  # noqa: E731
  result = trainer.run_loop(
    state,
    lambda s, batch: step_fn(s, frozen, batch),
    lambda s: {k: jnp.asarray(v) for k, v in train_data.batch_at(s).items()},
    eval_fn,
    manager,
    workdir=workdir,
    total=total,
    start=start,
    per_epoch=per_epoch,
    tokens_per_step=tc.batch_size * train_data.seq_len,
    eval_every=eval_every,
    loop=trainer.LoopConfig.from_train(tc, val_key="loss"),
    progress=progress,
  )
  trained = dataclasses.replace(drafter, params=dict(drafter.params, draft=result.params))
  return trained, result


def load_trained(drafter: Drafter, tc: DrafterTrainConfig, workdir: str) -> tuple[Drafter, int]:
  """`drafter` with the weights of the latest checkpoint under workdir (for export)."""
  state, _, _ = init_state(drafter, tc, total_steps=2)
  params, step = trainer.latest_params(workdir, state)
  return dataclasses.replace(drafter, params=dict(drafter.params, draft=params)), step
