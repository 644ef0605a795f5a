"""orbax checkpoints of model parameters, restorable onto any mesh.

Layout of a checkpoint directory: `config.json` (the HF config, so the architecture travels with
the weights), `params/` (an orbax StandardCheckpointer tree) and, when the model has one,
`tokenizer.json`. Restoring takes the target shardings (from the logical axis names and a mesh),
so a checkpoint written on one device layout loads onto another without a host gather.

Bad input (a missing directory, one holding neither format, a format or dtype name jaxspec does
not know, parameters that do not match config.json) raises CheckpointError or ConfigError with a
one-line message naming the path, never orbax's or the filesystem's own exceptions.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxspec import sharding as sharding_lib
from jaxspec.config import ModelConfig
from jaxspec.errors import CheckpointError, ConfigError
from jaxspec.io import architectures, gguf
from jaxspec.io.hf import load_config, load_model, save_hf
from jaxspec.models import target as target_lib
from jaxspec.options import RunOptions

PARAMS_DIR = "params"
FORMATS = ("hf", "orbax")
DTYPES = ("float32", "bfloat16", "float16")


def save(model: target_lib.TargetModel, out_dir: str) -> None:
  """Writes config.json, the parameters (orbax) and the tokenizer to out_dir.

  With several processes every one must call it (each writes its own shards of parameters
  that span processes); process 0 alone writes config.json and the tokenizer, before the
  parameters, so they exist once orbax's save, which waits for every process, returns.
  """
  out_dir = os.path.abspath(out_dir)
  os.makedirs(out_dir, exist_ok=True)
  if jax.process_index() == 0:
    hf_config = dict(model.hf_config or {})
    hf_config.update(architectures.config_to_hf(model.config))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
      json.dump(hf_config, f, indent=2, sort_keys=True)
    if model.tokenizer is not None:
      model.tokenizer.save_hf(out_dir)
  checkpointer = ocp.StandardCheckpointer()
  params = model.with_scan_layers(True).params  # one on-disk layout: stacked layers
  checkpointer.save(os.path.join(out_dir, PARAMS_DIR), params, force=True)
  checkpointer.wait_until_finished()


def abstract_params(
  config: ModelConfig, mesh: jax.sharding.Mesh | None = None, rules: Any = None
) -> Any:
  """ShapeDtypeStructs of the parameter tree, with shardings on `mesh` when given; else on this
  process's first device (with several processes, each then restores a whole copy of its own)."""
  shapes = target_lib.param_shapes(config)
  if mesh is None:
    device = jax.local_devices()[0]
    return jax.tree_util.tree_map(
      lambda s: jax.ShapeDtypeStruct(
        s.shape, s.dtype, sharding=jax.sharding.SingleDeviceSharding(device)
      ),
      shapes,
    )
  shardings = sharding_lib.shardings_for(shapes, target_lib.logical_axes(config), mesh, rules)
  return jax.tree_util.tree_map(
    lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
  )


def restore(
  ckpt_dir: str,
  mesh: jax.sharding.Mesh | None = None,
  rules: Any = None,
  scan_layers: bool | None = None,
  options: RunOptions | None = None,
  **config_overrides: Any,
) -> target_lib.TargetModel:
  """Loads a checkpoint written by `save`, placing each parameter with its target sharding.

  `mesh` may span several processes (jax.distributed): every process then calls `restore`
  with the same mesh and reads the shards its own devices hold. `options` and `scan_layers`
  are as `load_model`'s; `config_overrides` are ModelConfig (architecture) fields.
  """
  ckpt_dir = os.path.abspath(ckpt_dir)
  params_dir = os.path.join(ckpt_dir, PARAMS_DIR)
  if not os.path.isdir(params_dir):
    raise CheckpointError(f"{ckpt_dir} is not a jaxspec orbax checkpoint (no {PARAMS_DIR}/)")
  if options is not None:
    config_overrides["options"] = options
  config, hf_config = load_config(ckpt_dir, **config_overrides)
  if scan_layers is not None:
    config = config.with_options(scan_layers=scan_layers)
  stored = config.with_options(scan_layers=True)  # `save` writes stacked layers
  checkpointer = ocp.StandardCheckpointer()
  try:
    params = checkpointer.restore(params_dir, abstract_params(stored, mesh, rules))
  except (ValueError, KeyError, TypeError, OSError) as e:
    first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    raise CheckpointError(
      f"cannot restore {params_dir} for {config.architecture}: {first_line}"
    ) from None
  tokenizer = None
  if os.path.exists(os.path.join(ckpt_dir, "tokenizer.json")):
    from jaxspec.io import tokenizer as tokenizer_lib  # pylint: disable=import-outside-toplevel

    tokenizer = tokenizer_lib.Tokenizer.from_dir(ckpt_dir)
  model = target_lib.TargetModel(stored, params, tokenizer, hf_config)
  return model.with_scan_layers(config.options.scan_layers)


def convert(src: str, dst: str, to: str, dtype: str | None = None) -> target_lib.TargetModel:
  """Loads src in whichever format it is and writes dst in format `to` ('hf' or 'orbax').

  `src` is a HF or orbax checkpoint directory, or a GGUF file (`jaxspec.io.gguf`: written
  out dequantized). `to`, `dtype` and the paths are checked before anything is loaded:
  ConfigError for a format or dtype name jaxspec does not know, CheckpointError for a src that
  is neither a checkpoint directory nor a GGUF file, or a dst that is an existing file.
  """
  if to not in FORMATS:
    raise ConfigError(f"unknown checkpoint format {to!r}; expected 'hf' or 'orbax'")
  if dtype is not None and dtype not in DTYPES:
    raise ConfigError(f"unsupported dtype {dtype!r}; expected one of {', '.join(DTYPES)}")
  from_gguf = gguf.is_gguf(src) and os.path.isfile(src)
  if not from_gguf and not os.path.isdir(src):
    raise CheckpointError(f"checkpoint directory {src!r} does not exist")
  if os.path.exists(dst) and not os.path.isdir(dst):
    raise CheckpointError(f"output {dst!r} exists and is not a directory")
  if from_gguf:
    model = load_model(src)
  elif not os.path.isdir(os.path.join(src, PARAMS_DIR)) and not os.path.exists(
    os.path.join(src, "config.json")
  ):
    raise CheckpointError(
      f"{src} holds neither a HF checkpoint (config.json) nor a jaxspec orbax checkpoint "
      f"({PARAMS_DIR}/)"
    )
  elif os.path.isdir(os.path.join(src, PARAMS_DIR)):
    model = restore(src)
  else:
    model = load_model(src)
  if dtype is not None:
    model = target_lib.TargetModel(
      model.config.with_options(param_dtype=dtype),
      jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), model.params),
      model.tokenizer,
      model.hf_config,
    )
  if to == "hf":
    save_hf(model, dst)
  else:
    save(model, dst)
  return model
