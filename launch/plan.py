"""Plan memory and interconnect traffic from a HF config.json alone (no weights, no devices).

python launch/plan.py --config=configs/hf/deepseek_v3.json --mesh=expert=8 --policy=mxfp4_fp8 \
    --max_len=131072 --batch=1
python launch/plan.py --table        # the models in configs/hf on 8×H200 and 8×H100

The numbers and the traffic model are documented in jaxspec/plan/scale.py and docs/planning.md.
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxspec import sharding  # pylint: disable=wrong-import-position
from jaxspec.errors import ConfigError  # pylint: disable=wrong-import-position
from jaxspec.plan import arch, scale  # pylint: disable=wrong-import-position
from launch import cli  # pylint: disable=wrong-import-position
from launch.cli import common_flags  # pylint: disable=wrong-import-position

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE_MODELS = (
  ("DeepSeek-V3", "deepseek_v3.json"),
  ("Kimi-K2", "kimi_k2.json"),
  ("GLM-5", "glm_5.json"),
  ("Qwen3-235B-A22B", "qwen3_235b_a22b.json"),
  ("gpt-oss-120b", "gpt_oss_120b.json"),
  ("Qwen3.5-397B-A17B", "qwen3_5_397b_a17b.json"),
)

FLAGS = flags.FLAGS
flags.DEFINE_string("config", None, "A HF config.json (or a directory holding one).")
flags.DEFINE_string("mesh", "expert=8", "Mesh sizes, e.g. expert=8 or data=2,tensor=4.")
flags.DEFINE_string("policy", "bf16", f"Weight policy: {', '.join(scale.POLICIES)}.")
common_flags.define_kv_format()
common_flags.define_max_len(32768, "The planner sizes the decoding state for it.")
flags.DEFINE_integer("batch", 1, "Sequences decoded together.")
flags.DEFINE_integer("block", 16, "Tokens per sequence in one verify block.")
flags.DEFINE_string("drafter", "none", "none, mtp, dflash or eagle3.")
flags.DEFINE_integer("drafter_layers", 0, "DFlash drafter layers (0: one per 6 target layers).")
flags.DEFINE_list("accelerators", ["h200", "h100"], f"Of {', '.join(scale.ACCELERATORS)}.")
flags.DEFINE_list(
  "batch_axes",
  ["data"],
  "Mesh axes the batch (and so the KV cache) is split "
  "over, e.g. data,expert for data-parallel attention on an expert mesh.",
)
flags.DEFINE_bool("table", False, "Print the comparison table of the models in configs/hf.")


def read_config(path: str) -> dict:
  if os.path.isdir(path):
    path = os.path.join(path, "config.json")
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"cannot read config.json {path!r}: {e}") from None


def main(argv):
  del argv
  # The default rule table, with the batch rule first over --batch_axes.
  batch_rule = (
    "batch",
    tuple(FLAGS.batch_axes) if len(FLAGS.batch_axes) > 1 else FLAGS.batch_axes[0],
  )
  rules = (batch_rule,) + tuple(r for r in sharding.DEFAULT_RULES if r[0] != "batch")
  options = dict(
    kv_format=FLAGS.kv_format,
    batch=FLAGS.batch,
    block=FLAGS.block,
    drafter=FLAGS.drafter,
    drafter_layers=FLAGS.drafter_layers,
    rules=rules,
  )
  if FLAGS.table:
    specs = [
      arch.model_spec(read_config(os.path.join(REPO, "configs", "hf", f)), name)
      for name, f in TABLE_MODELS
    ]
    print(
      "\n".join(
        scale.comparison_table(
          specs, meshes=(scale.mesh_sizes(FLAGS.mesh),), accelerators=FLAGS.accelerators, **options
        )
      )
    )
    return
  if not FLAGS.config:
    raise ConfigError("pass --config=path/to/config.json, or --table")
  spec = arch.model_spec(read_config(FLAGS.config), os.path.basename(FLAGS.config))
  print(
    f"{spec.name}: {spec.architecture}, {spec.num_params:,} parameters ({spec.counted})"
  )
  result = scale.plan(spec, FLAGS.mesh, FLAGS.policy, max_len=FLAGS.max_len, **options)
  print("\n".join(result.describe(FLAGS.accelerators)))


if __name__ == "__main__":
  cli.run(main)
