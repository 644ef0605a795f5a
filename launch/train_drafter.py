"""Trains a DFlash or EAGLE-3 drafter on a frozen target by self-distillation, and exports it.

1. Self-distillation data: the target's own continuations (greedy and sampled) of function
   openings from the train split, generated with jaxspec's on-device decoding and stored under
   `config.distill_dir` (reused while the target, tokenizer and settings are unchanged); a
   small set from validation-split prompts measures held-out loss and acceptance.
2. Training (`jaxspec.train.drafter_trainer`): the frozen target produces the drafter's
   features on the fly, or, when the config has a `target_cache` section, once over the data
   beforehand (`jaxspec.train.target_cache`, beside the distillation data); Muon for matrices,
   AdamW for the rest; resumable orbax checkpoints in --workdir; TensorBoard-format metrics.
3. Export in the drafter's published layout (DFlash: z-lab `DFlashDraftModel`; EAGLE-3:
   SpecForge `LlamaForCausalLMEagle3`) to --export_dir, loadable with `jaxspec.load_drafter`.

Usage:
  python -m launch.train_drafter --config=configs/tiny_code.py:dflash
  python -m launch.train_drafter --config=configs/tiny_code.py:eagle3
  python -m launch.train_drafter --config=configs/tiny_code.py:dflash --export_only
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import cli  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "A drafter config, e.g. configs/tiny_code.py:dflash.", lock_config=True
)
_TARGET_DIR = flags.DEFINE_string("target_dir", None, "HF target; default config.target_dir.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics; default config.workdir.")
_EXPORT_DIR = flags.DEFINE_string(
  "export_dir", None, "Where to write the drafter; default config.export_dir ('' skips)."
)
_EXPORT_ONLY = flags.DEFINE_bool(
  "export_only", False, "Skip training; export the latest checkpoint of --workdir."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def main(argv):
  del argv
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel

  import jaxspec  # pylint: disable=import-outside-toplevel
  from jaxspec.drafters import registry  # pylint: disable=import-outside-toplevel
  from jaxspec.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  from jaxspec.train import (  # pylint: disable=import-outside-toplevel
    distill,
    drafter_trainer,
    target_cache,
  )

  config = cli.config_value(_CONFIG)
  required = ["method", "drafter", "distill", "val_distill", "distill_dir", "train"]
  required += [n for n, v in (("target_dir", _TARGET_DIR), ("workdir", _WORKDIR)) if not v.value]
  required += ["export_dir"] if _EXPORT_DIR.value is None else []
  cli.require_fields(_CONFIG, config, required, "a drafter config", "configs/tiny_code.py:dflash")
  target_dir = _TARGET_DIR.value or config.target_dir
  if not target_dir:
    raise app.UsageError("this config names no target: pass --target_dir")
  workdir = _WORKDIR.value or config.workdir
  export_dir = config.export_dir if _EXPORT_DIR.value is None else _EXPORT_DIR.value
  os.makedirs(workdir, exist_ok=True)
  target = jaxspec.load_model(target_dir)
  tokenizer = target.tokenizer or Tokenizer.bundled()
  tc = drafter_trainer.DrafterTrainConfig.from_mapping(config.train.to_dict())

  distill_dir = config.distill_dir or os.path.join(workdir, "distill")
  t0 = time.time()
  train_dir = distill.build(
    target, tokenizer, distill.DistillConfig.from_mapping(config.distill), distill_dir
  )
  val_dir = distill.build(
    target,
    tokenizer,
    distill.DistillConfig.from_mapping(config.val_distill),
    os.path.join(distill_dir, "validation"),
  )
  logging.info("distillation data ready in %.0f s", time.time() - t0)
  train_data = distill.DistillDataset(train_dir, tc.batch_size, seed=tc.data_seed)
  val_data = distill.DistillDataset(val_dir, tc.batch_size, shuffle=False)
  if config.get("target_cache"):  # the target's outputs stored once: steps never run it
    t0 = time.time()
    ccfg = target_cache.TargetCacheConfig(**config.target_cache.to_dict())
    train_data, val_data = (
      data.with_cache(target_cache.TargetCache(target_cache.build(target, folder, ccfg)))
      for data, folder in ((train_data, train_dir), (val_data, val_dir))
    )
    logging.info("target cache ready in %.0f s", time.time() - t0)
  counts = np.bincount(train_data.tokens[train_data.loss_mask], minlength=target.config.vocab_size)
  drafter = drafter_trainer.init_drafter(config.method, target, config.drafter, counts)
  if config.get("init_from"):  # continue from a published-layout drafter (same architecture)
    init = registry.load_drafter(config.init_from, target)
    drafter = drafter_trainer.warm_start(drafter, init)
    logging.info("initialised from %s", config.init_from)

  if _EXPORT_ONLY.value:
    drafter, step = drafter_trainer.load_trained(drafter, tc, workdir)
  else:
    t0 = time.time()
    drafter, result = drafter_trainer.train(
      drafter, target, tc, train_data, val_data, workdir, progress=_PROGRESS.value
    )
    step = result.step
    n_params = sum(
      int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(drafter.params["draft"])
    )
    summary = {
      "config": config.get("name", ""),
      "method": config.method,
      "step": step,
      "trainable_params": n_params,
      "distill_supervised_tokens": train_data.num_supervised,
      "seconds_this_process": time.time() - t0,
      "evals": result.history,
    }
    with open(os.path.join(workdir, f"summary_step{step}.json"), "w") as f:
      json.dump(summary, f, indent=2)
    logging.info("done at step %d: %s", step, summary)
  if export_dir:
    registry.save_drafter(drafter, export_dir)
    logging.info("exported the %s drafter (step %d) to %s", config.method, step, export_dir)


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
