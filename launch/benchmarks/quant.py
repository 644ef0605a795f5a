"""`bench.py quant`: bytes read and time per decode step of random models of realistic
shape, per weight format."""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from absl import flags
import jax

import jaxspec
from launch.cli import common_flags
from launch.benchmarks import cost_curve
from launch.benchmarks import runners

FLAGS = flags.FLAGS


def define_flags() -> None:
  """The quant benchmark's flags (defined when it runs)."""
  cost_curve.define_model_flags()
  flags.DEFINE_list(
    "quant_policies",
    ["float32", "bfloat16", "default"],
    "Weight formats: float32, bfloat16 (stored; computed in float32), a policy name or a "
    "policy JSON file.",
  )
  common_flags.define_out(None, "results JSON (default: ./quant_cost.json)")


def run_quant_costs(
  size: str, tokens: Sequence[int], max_len: int, policies: Sequence[str], out: str
) -> dict[str, Any]:
  """Per weight format (float32, bfloat16, quantization policies) of the
  cost_curve.COST_MODELS[size] models: stored weight bytes, bytes a decode step reads, and
  forward times at `tokens`."""
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel
  from jaxspec.quant import policy as policy_lib  # pylint: disable=import-outside-toplevel

  rows = []
  for kind, kw in cost_curve.COST_MODELS[size].items():
    make = roofline.dense_config if kind == "dense" else roofline.moe_config
    base = make(**kw).with_options(scan_layers=False)
    for name in policies:
      config, params = base, roofline.random_params(base)
      if name == "bfloat16":  # stored bf16, computed in float32 (XLA:CPU has no bf16 dots)
        config = base.with_options(param_dtype="bfloat16")
        params = jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16), params)
      elif name != "float32":
        params = jaxspec.quantize(
          jaxspec.TargetModel(base, params), policy_lib.load_policy(name)
        ).params
      points = roofline.cost_curve(config, params, tokens, max_len)
      stored = roofline.tree_bytes_stored(params)
      rows.append(
        {
          "model": kind,
          "weights": name,
          "stored_bytes": stored,
          "step_bytes": points[0].weight_bytes,
          "seconds": {p.tokens: p.seconds for p in points},
        }
      )
      del params
  f32 = {r["model"]: r for r in rows if r["weights"] == "float32"}
  lines = [
    f"{'model':>6} {'weights':>10} {'stored GB':>10} {'step reads GB':>14} "
    + "".join(f"{f't({t}) ms':>11}" for t in tokens)
    + f" {'tok/s (T=1)':>12} {'bytes × f32':>12}"
  ]
  for r in rows:
    base_bytes = f32.get(r["model"], r)["step_bytes"]
    lines.append(
      f"{r['model']:>6} {r['weights']:>10} {r['stored_bytes'] / 1e9:>10.3f} "
      f"{r['step_bytes'] / 1e9:>14.3f} "
      + "".join(f"{1e3 * r['seconds'][t]:>11.1f}" for t in tokens)
      + f" {1 / r['seconds'][tokens[0]]:>12.1f} {r['step_bytes'] / base_bytes:>12.3f}"
    )
  report = {"rows": rows, "table": "\n".join(lines), "out": out}
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=float)
  return report


def main(argv: Sequence[str]) -> None:
  del argv
  report = run_quant_costs(
    size=FLAGS.cost_size,
    tokens=tuple(int(t) for t in FLAGS.cost_tokens),
    max_len=FLAGS.cost_max_len,
    policies=FLAGS.quant_policies,
    out=FLAGS.out or runners.default_out("quant_cost"),
  )
  print(report["table"])
  print(f"\nsaved {report['out']}")
