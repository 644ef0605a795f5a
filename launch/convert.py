"""Convert checkpoints between the HF layout (config.json + safetensors) and orbax.

python launch/convert.py --input=hf_dir --output=ckpt_dir --to=orbax
python launch/convert.py --input=ckpt_dir --output=hf_dir --to=hf [--dtype=bfloat16]
python launch/convert.py --input=model.gguf --output=hf_dir --to=hf   # dequantized
"""

from __future__ import annotations

import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # pylint: disable=wrong-import-position

from jaxspec.io import checkpoint  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "input",
  None,
  "Source: a HF or jaxspec orbax checkpoint directory, or a GGUF file.",
  required=True,
)
flags.DEFINE_string("output", None, "Destination directory.", required=True)
flags.DEFINE_enum("to", None, ["hf", "orbax"], "Destination format.", required=True)
flags.DEFINE_enum(
  "dtype", None, ["float32", "bfloat16", "float16"], "Cast parameters (default: keep)."
)


def main(argv):
  del argv
  model = checkpoint.convert(FLAGS.input, FLAGS.output, FLAGS.to, FLAGS.dtype)
  n = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
  print(
    f"wrote {FLAGS.to} checkpoint of {model.config.architecture} ({n:,} parameters) to "
    f"{FLAGS.output}"
  )


if __name__ == "__main__":
  cli.run(main)
