"""Trains a jaxspec model (an MoE target with MTP layers, or a draft model) and exports it.

The config names the architecture (`config.model`, fields of jaxspec.config.ModelConfig) and
the hyper-parameters (`config.train`, fields of jaxspec.train.trainer.TrainConfig). Training
resumes from the last checkpoint in --workdir if there is one (same data order, same result as
an uninterrupted run). At the end the final parameters are written in HF layout
(config.json, model.safetensors, tokenizer files) to --export_dir.

Usage:
  python -m launch.train_target --config=configs/tiny_code.py:target
  python -m launch.train_target --config=configs/tiny_code.py:draft
  python -m launch.train_target --config=configs/tiny_code.py:target --export_only
  python -m launch.train_target --config=configs/tiny_code.py:test_target \
      --workdir=/tmp/run --config.train.num_steps=20
"""

from __future__ import annotations

import json
import os
import sys
import time

from absl import flags
from absl import logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import cli  # pylint: disable=wrong-import-position

_CONFIG = config_flags.DEFINE_config_file(
  "config", None, "A named config file, e.g. configs/tiny_code.py:target.", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints and metrics; default config.workdir.")
_EXPORT_DIR = flags.DEFINE_string(
  "export_dir",
  None,
  "Where to write the HF checkpoint; default config.export_dir ('' skips the export).",
)
_EXPORT_DTYPE = flags.DEFINE_enum(
  "export_dtype",
  None,
  ["float32", "bfloat16"],
  "Storage dtype of the exported weights; default config.export_dtype.",
)
_EXPORT_ONLY = flags.DEFINE_bool(
  "export_only", False, "Skip training; export the latest checkpoint of --workdir."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")


def export(model_config, params, tokenizer, out_dir: str, dtype: str = "float32") -> None:
  """Writes params in HF layout with the tokenizer files to out_dir."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  from jaxspec.io import hf  # pylint: disable=import-outside-toplevel
  from jaxspec.models.target import TargetModel  # pylint: disable=import-outside-toplevel

  # Inference uses the library's default expert backend. Weights may be stored in bfloat16
  # (half the bytes) while config.json keeps float32 as the compute dtype: jaxspec and
  # transformers both upcast on load and compute in float32 on the same rounded weights.
  cfg = model_config.with_options(moe_backend="ragged")
  params = jax.tree_util.tree_map(lambda x: jnp.asarray(x, dtype), params)
  hf.save_hf(TargetModel(cfg, params, None), out_dir)
  tokenizer.save_hf(out_dir)
  logging.info("exported %s to %s", model_config.architecture, out_dir)


def main(argv):
  del argv
  from jaxspec.io.tokenizer import Tokenizer  # pylint: disable=import-outside-toplevel
  from jaxspec.train import trainer  # pylint: disable=import-outside-toplevel

  config = cli.config_value(_CONFIG)
  required = ["model", "train"] + (["workdir"] if not _WORKDIR.value else [])
  required += ["export_dir"] if _EXPORT_DIR.value is None else []
  cli.require_fields(_CONFIG, config, required, "a model config", "configs/tiny_code.py:target")
  workdir = _WORKDIR.value or config.workdir
  export_dir = config.export_dir if _EXPORT_DIR.value is None else _EXPORT_DIR.value
  model_config = trainer.model_config_from(config.model)
  tc = trainer.TrainConfig.from_mapping(config.train.to_dict())
  tokenizer = Tokenizer.bundled()
  os.makedirs(workdir, exist_ok=True)

  if _EXPORT_ONLY.value:
    params, step = trainer.load_params(workdir, model_config, tc)
    logging.info("loaded step %d from %s", step, workdir)
  else:
    t0 = time.time()
    result = trainer.train(model_config, tc, workdir, tokenizer, progress=_PROGRESS.value)
    params, step = result.params, result.step
    summary = {
      "config": config.get("name", ""),
      "architecture": model_config.architecture,
      "step": step,
      "params": trainer.count_params(model_config, params),
      "seconds_this_process": time.time() - t0,
      "stopped_early": result.stopped_early,
      "evals": result.history,
    }
    with open(os.path.join(workdir, f"summary_step{step}.json"), "w") as f:
      json.dump(summary, f, indent=2)
    logging.info("done at step %d: %s", step, summary)
  if export_dir:
    export(
      model_config,
      params,
      tokenizer,
      export_dir,
      _EXPORT_DTYPE.value or config.get("export_dtype", "float32"),
    )


if __name__ == "__main__":
  flags.mark_flag_as_required("config")
  cli.run(main)
