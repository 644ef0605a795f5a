"""Convert checkpoints between the HF layout (config.json + safetensors) and orbax.

  python launch/convert.py --input=hf_dir --output=ckpt_dir --to=orbax
  python launch/convert.py --input=ckpt_dir --output=hf_dir --to=hf [--dtype=bfloat16]
"""

from __future__ import annotations

import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp  # pylint: disable=wrong-import-position

import jaxspec  # pylint: disable=wrong-import-position
from jaxspec.io import checkpoint  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "Source directory (HF or jaxspec orbax checkpoint).",
                    required=True)
flags.DEFINE_string("output", None, "Destination directory.", required=True)
flags.DEFINE_enum("to", None, ["hf", "orbax"], "Destination format.", required=True)
flags.DEFINE_enum("dtype", None, ["float32", "bfloat16", "float16"],
                  "Cast parameters (default: keep).")


def convert(src: str, dst: str, to: str, dtype: str | None = None) -> jaxspec.TargetModel:
  """Loads src in whichever format it is and writes dst in format `to`."""
  if os.path.isdir(os.path.join(src, checkpoint.PARAMS_DIR)):
    model = checkpoint.restore(src)
  else:
    model = jaxspec.load_model(src)
  if dtype is not None:
    model = jaxspec.TargetModel(
        model.config.replace(param_dtype=dtype),
        jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), model.params),
        model.tokenizer, model.hf_config)
  if to == "hf":
    jaxspec.save_hf(model, dst)
  else:
    checkpoint.save(model, dst)
  return model


def main(argv):
  del argv
  model = convert(FLAGS.input, FLAGS.output, FLAGS.to, FLAGS.dtype)
  n = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
  print(f"wrote {FLAGS.to} checkpoint of {model.config.architecture} ({n:,} parameters) to "
        f"{FLAGS.output}")


if __name__ == "__main__":
  app.run(main)
