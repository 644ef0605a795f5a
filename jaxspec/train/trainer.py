"""A resumable trainer for jaxspec models (targets with MTP layers, and draft models).

The whole update is one jitted function of an explicit state pytree (step, params, optimizer
state, early-stopping counters), donated so parameters are updated in place. Batch `s` is
`PackedDataset.batch_at(s)`, a pure function of the step, and the state is checkpointed with
orbax every `checkpoint_every` steps; a run killed at any moment (even SIGKILL) and started
again restores the last checkpoint and continues with the very batches it would have seen, so
it ends with the same parameters as an uninterrupted run. The validation split is evaluated
every `eval_every` steps (default: once per epoch) and never trained on.

Ctrl-C (SIGINT) stops a run cleanly: the step under way finishes, its state is checkpointed, and
`TrainingInterrupted` (a KeyboardInterrupt) is raised; a second Ctrl-C stops at once, except
during a checkpoint save or a metrics write, which always complete. A resumed run drops the
metrics that an earlier process logged past its last checkpoint, so every step is logged once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import signal
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import orbax.checkpoint as ocp
import tqdm
from absl import logging

from jaxspec.config import ModelConfig
from jaxspec.options import RunOptions
from jaxspec.errors import ConfigError
from jaxspec.models import target as target_lib
from jaxspec.train import data as data_lib
from jaxspec.train import losses, optim
from jaxspec.train.metrics_writer import MetricsWriter


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Training hyper-parameters (the `train` section of a named config)."""

  seq_len: int = 256
  batch_size: int = 16
  num_epochs: float = 1.0  # run length in epochs of the train split ...
  num_steps: int = 0  # ... unless this is positive
  schedule_steps: int = 0  # length of the LR schedule; 0: the run length
  learning_rate: float = 2e-3
  final_lr_fraction: float = 0.1
  warmup_steps: int = 200
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  optimizer: str = "adamw"  # or "muon"
  muon_learning_rate: float = 0.02
  mtp_weight: float = 0.3
  aux_loss_weight: float = 0.0  # switch-style balance loss
  bias_update_rate: float = 1e-3  # DeepSeek aux-free balancing of e_score_correction_bias
  seed: int = 0  # parameter init
  data_seed: int = 0  # batch order
  checkpoint_every: int = 100
  keep_checkpoints: int = 2
  eval_every: int = 0  # 0: once per epoch (and at the end)
  eval_batches: int = 0  # 0: the whole validation split
  patience: int = 0  # stop after this many evaluations without improvement (0: never)
  log_every: int = 10
  corpus_root: str = ""  # "" : the standard library
  step_delay_s: float = 0.0  # sleep after each step; only for interruption tests

  @classmethod
  def from_mapping(cls, m: Mapping[str, Any]) -> "TrainConfig":
    return dataclass_from_mapping(cls, m, "train config")


def dataclass_from_mapping(cls: type, m: Mapping[str, Any], what: str) -> Any:
  """cls(**m), rejecting keys that are not fields of the dataclass (config typos)."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(m) - names)
  if unknown:
    raise ConfigError(f"unknown {what} field(s): {unknown}")
  return cls(**dict(m))


def model_config_from(m: Mapping[str, Any] | ml_collections.ConfigDict) -> ModelConfig:
  """A ModelConfig from a config section (lists become tuples); its `options` sub-section, if
  any, holds the RunOptions fields."""
  d = m.to_dict() if isinstance(m, ml_collections.ConfigDict) else dict(m)
  options = RunOptions(**d.pop("options", {}))
  fields = {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}
  return ModelConfig(**fields, options=options)


def count_params(config: ModelConfig, params: Any) -> dict[str, int]:
  """Total and active (per token) parameter counts, with and without embeddings/head.

  Active counts only `num_experts_per_tok` of the routed experts of each MoE layer; the MTP
  layers are counted separately (`mtp`), since plain decoding never runs them.
  """
  leaves = jax.tree_util.tree_leaves_with_path(params)
  total = main = mtp = embed = inactive = 0
  for path, leaf in leaves:
    names = [getattr(k, "key", str(k)) for k in path]
    n = int(np.prod(leaf.shape))
    total += n
    if names[0].startswith("mtp_"):
      mtp += n
    else:
      main += n
    if names[0] in ("embed", "lm_head"):
      embed += n
    if (
      names[-1] in ("gate_proj", "up_proj", "down_proj")
      and "shared_experts" not in names
      and names[-2] == "mlp"
      and not names[0].startswith("mtp_")
    ):
      inactive += n * (config.num_experts - config.num_experts_per_tok) // config.num_experts
  active = main - inactive
  return {
    "total": total,
    "main": main,
    "mtp": mtp,
    "active": active,
    "active_non_embedding": active - embed,
    "embedding": embed,
  }


# --------------------------------------------------------------------------------------------------
# State and steps
# --------------------------------------------------------------------------------------------------


def init_state(
  config: ModelConfig, tc: TrainConfig, total_steps: int
) -> tuple[dict[str, Any], optax.GradientTransformation, optax.Schedule]:
  """Fresh training state {step, params, opt_state, best_val, bad_evals} and its optimizer."""
  return new_state(target_lib.init_params(config, tc.seed), tc, total_steps)


def new_state(
  params: Any, tc: Any, total_steps: int, muon_dims: Callable[[Any], Any] = optim.muon_dimensions
) -> tuple[dict[str, Any], optax.GradientTransformation, optax.Schedule]:
  """The state {step, params, opt_state, best_val, bad_evals} of `params` and the optimizer
  that tc's optimizer fields (learning_rate, warmup_steps, …, optimizer) describe."""
  opt, schedule = optim.make_optimizer(
    params,
    total_steps=total_steps,
    learning_rate=tc.learning_rate,
    warmup_steps=tc.warmup_steps,
    final_lr_fraction=tc.final_lr_fraction,
    weight_decay=tc.weight_decay,
    b1=tc.b1,
    b2=tc.b2,
    grad_clip=tc.grad_clip,
    name=tc.optimizer,
    muon_learning_rate=tc.muon_learning_rate,
    muon_dims=muon_dims,
  )
  state = {
    "step": jnp.int32(0),
    "params": params,
    "opt_state": opt.init(params),
    "best_val": jnp.float32(jnp.inf),
    "bad_evals": jnp.int32(0),
  }
  return state, opt, schedule


def make_train_step(
  config: ModelConfig, tc: TrainConfig, opt: optax.GradientTransformation, schedule: optax.Schedule
) -> Callable:
  """The jitted update: (state, batch [B, T+1]) → (state, scalar metrics); state is donated."""

  # Aux-loss-free balancing steers the sigmoid router's e_score_correction_bias; a softmax
  # router (Qwen3-MoE / Qwen3.5) has none and is balanced by aux_loss_weight instead.
  bias_rate = tc.bias_update_rate if config.router == "sigmoid" else 0.0

  def loss_fn(params, batch):
    return losses.lm_losses(
      config, params, batch, mtp_weight=tc.mtp_weight, aux_weight=tc.aux_loss_weight
    )

  @functools.partial(jax.jit, donate_argnums=(0,))
  def step(state, batch):
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"], batch)
    updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    loads = aux.pop("expert_load")
    params = losses.bias_update(params, loads, bias_rate)
    metrics = dict(aux, grad_norm=optax.tree.norm(grads), lr=schedule(state["step"]))
    if loads:
      metrics["max_violation"] = jnp.mean(
        jnp.stack([losses.max_violation(l) for l in loads.values()])
      )
    new_state = dict(state, step=state["step"] + 1, params=params, opt_state=opt_state)
    return new_state, metrics

  return step


def make_eval_step(config: ModelConfig, tc: TrainConfig) -> Callable:
  """Jitted (params, batch) → {lm_loss, mtp_loss_k} means over the batch's tokens."""

  @jax.jit
  def step(params, batch):
    _, aux = losses.lm_losses(config, params, batch, mtp_weight=tc.mtp_weight)
    return {k: v for k, v in aux.items() if k == "lm_loss" or k.startswith("mtp_loss")}

  return step


def evaluate(
  eval_step: Callable, params: Any, dataset: data_lib.PackedDataset, max_batches: int = 0
) -> dict[str, float]:
  """Mean losses over the dataset's batches (in stream order), plus perplexities."""
  n = dataset.batches_per_epoch if max_batches <= 0 else min(max_batches, dataset.batches_per_epoch)
  means = mean_metrics(lambda i: eval_step(params, jnp.asarray(dataset.batch_at(i))), n)
  means.update({k.replace("loss", "ppl"): math.exp(v) for k, v in list(means.items())})
  return means


def mean_metrics(metrics_at: Callable[[int], Mapping[str, Any]], n: int) -> dict[str, float]:
  """Mean of each scalar metric over batches 0..n−1 (`metrics_at(i)` → {name: scalar})."""
  sums: dict[str, float] = {}
  for i in range(n):
    for k, v in jax.device_get(metrics_at(i)).items():
      sums[k] = sums.get(k, 0.0) + float(v)
  return {k: v / n for k, v in sums.items()}


# --------------------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------------------


def checkpoint_manager(
  workdir: str, keep: int = 2, remove_partial: bool = True
) -> ocp.CheckpointManager:
  """Synchronous orbax manager under <workdir>/checkpoints.

  Saves are atomic: orbax writes a step to `<step>.orbax-checkpoint-tmp-*` and renames it when
  complete, so a killed save leaves no half-written step that `latest_step` would pick;
  `remove_partial` deletes such leftovers when the manager opens (a training run's manager;
  a reader beside a running job should pass False).
  """
  return ocp.CheckpointManager(
    os.path.abspath(os.path.join(workdir, "checkpoints")),
    options=ocp.CheckpointManagerOptions(
      max_to_keep=keep,
      enable_async_checkpointing=False,
      create=True,
      cleanup_tmp_directories=remove_partial,
    ),
  )


def restore_latest(manager: ocp.CheckpointManager, state: Any) -> tuple[Any, int | None]:
  """Restores the latest checkpoint into `state`'s structure; (state, step or None)."""
  step = manager.latest_step()
  if step is None:
    return state, None
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, state)
  return manager.restore(step, args=ocp.args.StandardRestore(abstract)), step


def load_params(workdir: str, config: ModelConfig, tc: TrainConfig) -> tuple[Any, int]:
  """The parameters of the latest checkpoint of a run (for export and tests)."""
  state, _, _ = init_state(config, tc, total_steps=2)
  return latest_params(workdir, state)


def latest_params(workdir: str, state: Any) -> tuple[Any, int]:
  """(params, step) of the latest checkpoint under workdir, restored into `state`'s structure."""
  with checkpoint_manager(workdir, remove_partial=False) as manager:
    state, step = restore_latest(manager, state)
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  return state["params"], step


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


class TrainingInterrupted(KeyboardInterrupt):
  """Ctrl-C stopped training at `step`, after checkpointing it (`checkpoint` is None when no
  checkpoint exists yet); running the same command again resumes there."""

  def __init__(self, step: int, checkpoint: str | None):
    if checkpoint is None:
      message = f"training stopped at step {step}, before its first checkpoint"
    else:
      message = f"training stopped at step {step}; its checkpoint in {checkpoint} resumes the run"
    super().__init__(message)
    self.step = step
    self.checkpoint = checkpoint


class _InterruptGuard:
  """SIGINT handling for the training loop (main thread only; elsewhere a no-op).

  The first Ctrl-C only sets `requested`, which the loop checks between steps; a second one
  raises KeyboardInterrupt at once, unless it lands inside `critical()`, which then completes
  first. A signal handler cannot safely write to a stream, so it prints nothing.
  """

  def __init__(self):
    self.requested = False
    self._depth = 0
    self._pending = False
    self._previous: Any = None

  def __enter__(self) -> "_InterruptGuard":
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGINT, self._handle)
    return self

  def __exit__(self, *exc: Any) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGINT, self._previous)
      self._previous = None

  def _handle(self, signum: int, frame: Any) -> None:
    del signum, frame
    if not self.requested:
      self.requested = True
    elif self._depth:
      self._pending = True
    else:
      raise KeyboardInterrupt

  @contextlib.contextmanager
  def critical(self) -> Iterator[None]:
    """A section that a second Ctrl-C does not cut short (checkpoint saves, metrics rows)."""
    self._depth += 1
    try:
      yield
    finally:
      self._depth -= 1
      if not self._depth and self._pending:
        self._pending = False
        raise KeyboardInterrupt


@dataclasses.dataclass
class TrainResult:
  params: Any
  step: int
  history: list[dict[str, float]]  # one entry per evaluation
  seconds: float  # wall time of this process's training loop
  stopped_early: bool


def train(
  config: ModelConfig, tc: TrainConfig, workdir: str, tokenizer: Any, progress: bool = True
) -> TrainResult:
  """Trains (or resumes training) a model on the corpus train split; see the module docstring.

  Args:
    config: model architecture (float32 on CPU).
    tc: hyper-parameters.
    workdir: holds checkpoints/ and tb/ (TensorBoard events and metrics.jsonl).
    tokenizer: a jaxspec Tokenizer (its ids must match config.vocab_size).
    progress: show a tqdm progress bar.

  Returns:
    The final parameters, the last step and the evaluation history of this process.
  """
  if tokenizer.vocab_size != config.vocab_size:
    raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids, model {config.vocab_size}")
  root = tc.corpus_root or None
  train_ds = data_lib.PackedDataset.from_corpus(
    tokenizer,
    data_lib.TRAIN,
    seq_len=tc.seq_len,
    batch_size=tc.batch_size,
    seed=tc.data_seed,
    root=root,
  )
  val_ds = data_lib.PackedDataset.from_corpus(
    tokenizer,
    data_lib.VALIDATION,
    seq_len=tc.seq_len,
    batch_size=tc.batch_size,
    root=root,
    shuffle=False,
  )
  per_epoch = train_ds.batches_per_epoch
  total = tc.num_steps if tc.num_steps > 0 else max(1, int(round(tc.num_epochs * per_epoch)))
  eval_every = tc.eval_every if tc.eval_every > 0 else per_epoch

  state, opt, schedule = init_state(config, tc, tc.schedule_steps or total)
  manager = checkpoint_manager(workdir, tc.keep_checkpoints)
  state, restored = restore_latest(manager, state)
  start = 0 if restored is None else int(state["step"])
  if restored is not None:
    logging.info("resumed from checkpoint at step %d", start)
  counts = count_params(config, state["params"])
  logging.info(
    "%s: %s params; %d steps (%d per epoch of %d tokens), %d tokens per step",
    config.architecture,
    counts,
    total,
    per_epoch,
    train_ds.num_tokens,
    tc.batch_size * tc.seq_len,
  )

  train_step = make_train_step(config, tc, opt, schedule)
  eval_step = make_eval_step(config, tc)
  return run_loop(
    state,
    train_step,
    lambda s: jnp.asarray(train_ds.batch_at(s)),
    lambda params: evaluate(eval_step, params, val_ds, tc.eval_batches),
    manager,
    workdir=workdir,
    total=total,
    start=start,
    per_epoch=per_epoch,
    tokens_per_step=tc.batch_size * tc.seq_len,
    eval_every=eval_every,
    loop=LoopConfig.from_train(tc),
    progress=progress,
  )


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The cadence of `run_loop` (logging, checkpoints, early stopping)."""

  log_every: int = 10
  checkpoint_every: int = 100
  patience: int = 0
  step_delay_s: float = 0.0
  val_key: str = "lm_loss"  # the evaluation metric early stopping watches (lower is better)

  @classmethod
  def from_train(cls, tc: Any, val_key: str = "lm_loss") -> "LoopConfig":
    return cls(tc.log_every, tc.checkpoint_every, tc.patience, tc.step_delay_s, val_key)


def run_loop(
  state: dict[str, Any],
  train_step: Callable,
  batch_at: Callable[[int], Any],
  eval_fn: Callable[[Any], dict[str, float]],
  manager: ocp.CheckpointManager,
  *,
  workdir: str,
  total: int,
  start: int,
  per_epoch: int,
  tokens_per_step: int,
  eval_every: int,
  loop: LoopConfig,
  progress: bool = True,
) -> TrainResult:
  """The resumable training loop shared by targets and drafters.

  `state` holds at least {step, params, best_val, bad_evals}; `train_step(state, batch)` →
  (state, metrics with a "loss"); `batch_at(step)` is a pure function of the step;
  `eval_fn(params)` → validation metrics (must include `loop.val_key`). Metrics go to
  <workdir>/tb; the state is saved with `manager` every `loop.checkpoint_every` steps, after
  every evaluation and at the end. The manager is closed on return.

  `start` is the step of the restored checkpoint (0: a fresh run); metrics rows an earlier
  process logged past it are dropped, since the steps after it run again. Ctrl-C checkpoints
  the current step and raises `TrainingInterrupted` (see the module docstring).
  """
  writer = MetricsWriter(os.path.join(workdir, "tb"), resume_step=start)
  guard = _InterruptGuard()
  saved = start if start > 0 else None  # the step of the newest checkpoint
  history: list[dict[str, float]] = []
  stopped = False
  t_start = time.time()
  bar = tqdm.tqdm(
    total=total,
    initial=start,
    disable=not progress,
    dynamic_ncols=True,
    mininterval=2.0,
    desc="train",
  )
  t_log, step_log = time.time(), start
  step = start
  with guard:
    try:
      while step < total and not stopped and not guard.requested:
        state, metrics = train_step(state, batch_at(step))
        step += 1
        if loop.step_delay_s:
          time.sleep(loop.step_delay_s)
        if step % loop.log_every == 0 or step == total:
          m = {k: float(v) for k, v in jax.device_get(metrics).items()}
          now = time.time()
          m["tokens_per_s"] = (step - step_log) * tokens_per_step / max(now - t_log, 1e-9)
          m["epoch"] = step / per_epoch
          t_log, step_log = now, step
          with guard.critical():
            writer.write_scalars(step, {f"train/{k}": v for k, v in m.items()})
          bar.set_postfix(loss=f"{m['loss']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}", refresh=False)
          if not progress:
            logging.info("step %d loss %.4f tok/s %.0f", step, m["loss"], m["tokens_per_s"])
        bar.update(1)
        evaluated = False
        if step % eval_every == 0 or step == total:
          ev = eval_fn(state["params"])
          ev["step"], ev["epoch"] = step, step / per_epoch
          history.append(ev)
          with guard.critical():
            writer.write_scalars(
              step, {f"val/{k}": v for k, v in ev.items() if k not in ("step", "epoch")}
            )
          logging.info("eval at step %d (epoch %.2f): %s", step, step / per_epoch, ev)
          bar.write(
            f"eval step {step}: "
            + ", ".join(f"{k}={v:.4f}" for k, v in ev.items() if k not in ("step",))
          )
          best, bad = float(state["best_val"]), int(state["bad_evals"])
          bad = 0 if ev[loop.val_key] < best else bad + 1
          state = dict(
            state, best_val=jnp.float32(min(best, ev[loop.val_key])), bad_evals=jnp.int32(bad)
          )
          stopped = loop.patience > 0 and bad >= loop.patience
          evaluated = True
        with guard.critical():
          writer.flush()
          if step % loop.checkpoint_every == 0 or evaluated or step == total or stopped:
            manager.save(step, args=ocp.args.StandardSave(state), force=True)
            saved = step
      if guard.requested:
        if saved != step and step > 0:
          with guard.critical():
            manager.save(step, args=ocp.args.StandardSave(state), force=True)
            saved = step
        directory = os.fspath(manager.directory) if saved is not None else None
        raise TrainingInterrupted(step, directory)
    finally:
      with guard.critical():
        bar.close()
        writer.close()
        manager.wait_until_finished()
        manager.close()
  return TrainResult(state["params"], step, history, time.time() - t_start, stopped)
