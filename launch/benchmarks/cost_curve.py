"""`bench.py cost-curve`: forward cost against T on random models of realistic shape, the
memory roofline, and projected speedups."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional, Sequence

from absl import flags
import jax

import jaxspec
from jaxspec.drafters import registry
from launch.cli import common_flags
from launch.benchmarks import runners

FLAGS = flags.FLAGS


def define_model_flags() -> None:
  """The random models' size, the token counts T and the cache length (cost-curve, quant)."""
  flags.DEFINE_enum("cost_size", "1gb", ["1gb", "tiny"], "Model sizes (tiny: seconds, for tests).")
  flags.DEFINE_list("cost_tokens", ["1", "2", "4", "8", "16", "32", "64"], "T values.")
  flags.DEFINE_integer("cost_max_len", 1024, "Cache length (forwards at max_len/2).")


def define_flags() -> None:
  """The cost-curve benchmark's flags (defined when it runs)."""
  define_model_flags()
  flags.DEFINE_integer("cost_prompts", 8, "Bundled-pair prompts measuring τ.")
  common_flags.define_out(None, "results JSON (default: ./cost_curve.json); the plot beside it")


# (dense, MoE) model shapes of ≥ 1 GB of float32 weights, and tiny ones for tests.
COST_MODELS = {
  "1gb": {
    "dense": dict(hidden=2048, layers=4, intermediate=8192, vocab=32768),
    "moe": dict(
      hidden=2048, layers=2, experts=32, experts_per_tok=4, expert_intermediate=768, vocab=32768
    ),
  },
  "tiny": {
    "dense": dict(hidden=64, layers=2, intermediate=128, vocab=512, head_dim=16, kv_heads=2),
    "moe": dict(
      hidden=64,
      layers=2,
      experts=8,
      experts_per_tok=2,
      expert_intermediate=32,
      vocab=512,
      head_dim=16,
      kv_heads=2,
    ),
  },
}

# What the bundled pair runs for the projection: (label, drafter method, γ, tree budget or 0).
PROJECTED_METHODS = (
  ("eagle3 chain γ=4", "eagle3", 4, 0),
  ("eagle3 chain γ=15", "eagle3", 15, 0),
  ("dflash chain γ=15", "dflash", 15, 0),
  ("dflash + ddtree 8", "dflash", 15, 8),
  ("dflash + ddtree 22", "dflash", 15, 22),
  ("dflash + ddtree 32", "dflash", 15, 32),
)


def measure_acceptance(num_prompts: int, max_new_tokens: int = 96) -> dict[str, float]:
  """Pooled acceptance length τ (tokens per verify pass, bonus included) of each
  PROJECTED_METHODS entry on the bundled target and drafters, greedy; {} without them."""
  target_dir = registry.bundled_dir("target")
  if target_dir is None or num_prompts < 1:
    return {}
  target = jaxspec.load_model(target_dir, scan_layers=False)
  texts = data_prompts(num_prompts)
  prompts = [target.tokenizer.encode(t) for t in texts]
  max_len = -(-(max(map(len, prompts)) + max_new_tokens + 34) // 64) * 64
  taus = {}
  for label, method, gamma, budget in PROJECTED_METHODS:
    if registry.bundled_dir(method) is None:
      continue
    drafter = registry.make_drafter(
      method, target, gamma=gamma, draft_dir=registry.bundled_dir(method)
    )
    tree = dict(verify="tree", tree_budget=budget) if budget else {}
    engine = jaxspec.SpecEngine(
      target, drafter, jaxspec.EngineConfig(max_len=max_len, use_eos=False, **tree)
    )
    tokens = passes = 0
    for p in prompts:
      out = engine.generate([p], max_new_tokens=max_new_tokens)
      tokens += out.stats.tokens_generated
      passes += out.stats.target_passes
    taus[label] = tokens / max(passes, 1)
  return taus


def data_prompts(n: int, seed: int = 0, root: Optional[str] = None) -> list[str]:
  """n function openings from the validation split (the bench's default prompts) of the
  standard library, or of the Python sources under `root` (e.g. a third-party package the
  target never saw)."""
  from jaxspec.train import data  # pylint: disable=import-outside-toplevel

  return data.function_prompts(split="validation", n=n, seed=seed, root=root)


def run_cost_curves(
  size: str, tokens: Sequence[int], max_len: int, num_prompts: int, out: str
) -> dict[str, Any]:
  """Cost curves of the COST_MODELS[size] models (both layer layouts for the dense one), the
  reference bandwidth, drafter step costs at each model's scale, and projected speedups
  τ · t(1) / (t_verify + t_draft) with τ measured on the bundled pair. Saves JSON and a PNG."""
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  shapes = COST_MODELS[size]
  bandwidth = roofline.reference_bandwidth(roofline.GIB if size == "1gb" else 1 << 24)
  peak_flops = roofline.reference_flops(2048 if size == "1gb" else 256)
  position = max_len // 2
  curves: dict[str, list] = {}
  drafts: dict[str, dict[str, float]] = {}
  lines = [
    f"reference bandwidth: stream {bandwidth['stream'] / 1e9:.1f} GB/s, matvec "
    f"{bandwidth['matvec'] / 1e9:.1f} GB/s (float32, jax {jax.__version__}, "
    f"{jax.default_backend()}); compute ceiling {peak_flops / 1e9:.0f} GFLOP/s (one square "
    f"matmul; ridge point {peak_flops / bandwidth['best']:.1f} FLOP/byte); forwards at "
    f"position {position} of {max_len}",
    "",
  ]
  for kind, kw in shapes.items():
    make = roofline.dense_config if kind == "dense" else roofline.moe_config
    layouts = (False, True) if kind == "dense" else (False,)
    for scan in layouts:
      config = make(**kw).with_options(scan_layers=scan)
      params = roofline.random_params(config)
      name = f"{kind} ({'scanned' if scan else 'unrolled'} layers)"
      curves[name] = roofline.cost_curve(config, params, tokens, max_len, position)
      lines += roofline.curve_table(name, curves[name], bandwidth["best"], peak_flops) + [""]
      if not scan:
        target = jaxspec.TargetModel(config, params)
        drafts[kind] = {}
        for label, method, gamma, _ in PROJECTED_METHODS:
          key = f"{method} γ={gamma}"
          if key not in drafts[kind]:
            drafter = roofline.random_drafter(method, target, gamma)
            drafts[kind][key] = roofline.drafter_step_seconds(
              drafter, config.hidden_size, max_len, position
            )
      del params
  taus = measure_acceptance(num_prompts)
  projections: dict[str, dict[str, float]] = {}
  if taus:
    lines.append(
      "projected speedup over plain decoding: τ · t(1) / (t_verify + t_draft), τ "
      "pooled on the bundled pair (greedy), costs of the random models above"
    )
    lines.append(f"{'method':<22}{'τ':>6}" + "".join(f"{k:>14}" for k in drafts))
    for label, method, gamma, budget in PROJECTED_METHODS:
      if label not in taus:
        continue
      width = (budget or gamma) + 1
      row = f"{label:<22}{taus[label]:>6.2f}"
      for kind in drafts:
        pts = curves[f"{kind} (unrolled layers)"]
        t_draft = drafts[kind][f"{method} γ={gamma}"]
        sp = roofline.project_speedup(
          taus[label], pts[0].seconds, roofline.interpolate(pts, width), t_draft
        )
        projections.setdefault(label, {})[kind] = sp
        row += f"{sp:>13.2f}×"
      lines.append(row)
    lines.append(
      "drafter step ms: "
      + "; ".join(
        f"{kind}: " + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in d.items())
        for kind, d in drafts.items()
      )
    )
  report = {
    "bandwidth_bytes_per_s": bandwidth,
    "peak_flops_per_s": peak_flops,
    "max_len": max_len,
    "position": position,
    "curves": {name: [dataclasses.asdict(p) for p in pts] for name, pts in curves.items()},
    "drafter_step_s": drafts,
    "acceptance_length": taus,
    "projected_speedup": projections,
    "machine": runners.machine_facts(
      None, list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    ),
    "table": "\n".join(lines),
    "out": out,
  }
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, default=float)
  png = os.path.splitext(out)[0] + ".png"
  report["plot"] = png if plot_curves(curves, bandwidth["best"], png, peak_flops) else None
  return report


def plot_curves(
  curves: dict[str, Sequence[Any]], bandwidth: float, path: str, flops_per_s: float = 0.0
) -> bool:
  """t(T)/t(1) and roofline % against T (`roofline.CostPoint`s), one line per model, as a PNG;
  with a compute ceiling the second panel also draws each model's attainable % (roofline time
  over byte time, dashed). False without matplotlib."""
  from jaxspec.profiling import roofline  # pylint: disable=import-outside-toplevel

  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return False
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  for name, pts in curves.items():
    ts = [p.tokens for p in pts]
    ax1.plot(ts, [p.seconds / pts[0].seconds for p in pts], marker="o", label=name)
    line = ax2.plot(
      ts, [100 * p.weight_bytes / bandwidth / p.seconds for p in pts], marker="o", label=name
    )[0]
    if flops_per_s:
      floor = [roofline.roofline_seconds(p, bandwidth, flops_per_s) for p in pts]
      attainable = [100 * p.weight_bytes / bandwidth / f for p, f in zip(pts, floor)]
      ax2.plot(ts, attainable, ls="--", color=line.get_color(), lw=0.8)
  for ax, title in ((ax1, "forward time t(T) / t(1)"), (ax2, "weight-read roofline %")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per forward (T)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
  ax1.axhline(1.5, color="gray", ls="--", lw=0.8)
  ax2.axhline(70, color="gray", ls="--", lw=0.8)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return True


def main(argv: Sequence[str]) -> None:
  del argv
  report = run_cost_curves(
    size=FLAGS.cost_size,
    tokens=tuple(int(t) for t in FLAGS.cost_tokens),
    max_len=FLAGS.cost_max_len,
    num_prompts=FLAGS.cost_prompts,
    out=FLAGS.out or runners.default_out("cost_curve"),
  )
  print(report["table"])
  print(f"\nsaved {report['out']} and {report['plot'] or '(no plot: matplotlib missing)'}")
