"""Quantization sensitivity of a target, per layer and module kind, and the policy it implies.

Each group (a layer's experts, shared experts, MLP, attention or router; the LM head; the MTP
layers) is quantized alone in each format that fits it and measured on held-out validation
tokens against the unquantized target: KL(p_full ‖ p_q), top-1 agreement, Δ perplexity and,
with a drafter, Δ acceptance length. The policy with the fewest bytes whose measured KL stays
under --kl_budget is then chosen and written as a JSON policy that `jaxspec.quantize` (via
`jaxspec.quant.policy.load_policy`) and `launch/generate.py --quant_policy` accept.

  python launch/bench.py quant-profile                    # the bundled target, DFlash Δτ
  python launch/bench.py quant-profile --kl_budget=0.005 --drafter=none --out=/tmp/q
  python launch/generate.py --quant_policy=/tmp/jaxspec_quant/policy.json
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

from absl import flags
import numpy as np

import jaxspec
from jaxspec.drafters import registry
from jaxspec.profiling import sensitivity as profile_lib
from jaxspec.quant import policy as policy_lib
from launch.cli import common_flags

FLAGS = flags.FLAGS


def define_flags() -> None:
  """This benchmark's flags (defined when it runs)."""
  flags.DEFINE_string("model", None, "HF model directory (default: the bundled target).")
  flags.DEFINE_enum(
    "drafter", "dflash", ["none", "dflash", "eagle3", "mtp"], "Drafter for Δ acceptance length."
  )
  flags.DEFINE_string("draft_dir", None, "Drafter checkpoint (default: the bundled one).")
  flags.DEFINE_integer("windows", 8, "Held-out windows of validation text.")
  flags.DEFINE_integer("window_len", 256, "Tokens per held-out window.")
  flags.DEFINE_integer("acceptance_prompts", 4, "Prompts for Δ acceptance length.")
  flags.DEFINE_integer("max_new", 48, "Tokens generated per acceptance prompt.")
  flags.DEFINE_float("kl_budget", 0.01, "Largest mean KL(p_full ‖ p_quantized) the policy may cost.")
  common_flags.define_out("/tmp/jaxspec_quant", "a folder: profile.json, policy.json, PNG")


def _drafter_fn():
  if FLAGS.drafter == "none":
    return None
  draft_dir = FLAGS.draft_dir or (
    registry.bundled_dir(FLAGS.drafter) if FLAGS.drafter != "mtp" else None
  )
  return lambda target: registry.make_drafter(FLAGS.drafter, target, draft_dir=draft_dir)


def table(results: Sequence[profile_lib.GroupResult]) -> list[str]:
  lines = [
    f"{'group':>18} {'format':>6} {'bytes':>10} {'→ bytes':>9} {'KL':>9} {'top-1':>7} "
    f"{'Δppl':>7} {'Δτ':>7}"
  ]
  for r in results:
    tau = "" if r.tau_delta is None else f"{r.tau_delta:+.1%}"
    lines.append(
      f"{r.pattern:>18} {r.format:>6} {r.bytes_before:>10,} {r.bytes_after:>9,} {r.kl:>9.2e} "
      f"{r.top1:>7.1%} {r.ppl_delta:>+7.2%} {tau:>7}"
    )
  return lines


def plot(results: Sequence[profile_lib.GroupResult], path: str) -> str | None:
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    return None
  formats = sorted({r.format for r in results})
  fig, axes = plt.subplots(1, len(formats), figsize=(6 * len(formats), 4), squeeze=False)
  for ax, fmt in zip(axes[0], formats):
    rows = [r for r in results if r.format == fmt]
    roles = sorted({r.role for r in rows})
    for k, role in enumerate(roles):
      pts = [(r.layer if r.layer is not None else -1, r.kl) for r in rows if r.role == role]
      xs = np.asarray([p[0] for p in pts]) + (k - len(roles) / 2) * 0.12
      ax.bar(xs, [max(p[1], 1e-8) for p in pts], width=0.12, label=role)
    ax.set_yscale("log")
    ax.set_xlabel("layer (−1: outside the layer stack)")
    ax.set_ylabel("KL(p_full ‖ p_quantized), held-out tokens")
    ax.set_title(f"{fmt}: each group quantized alone")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(argv: Sequence[str]) -> None:
  del argv
  model_dir = FLAGS.model or registry.bundled_dir("target")
  target = jaxspec.load_model(model_dir, scan_layers=False)
  if target.tokenizer is None:
    raise jaxspec.ConfigError(f"{model_dir} has no tokenizer.json: held-out text needs one")
  os.makedirs(FLAGS.out, exist_ok=True)
  tokens = profile_lib.held_out_windows(target.tokenizer, FLAGS.windows, FLAGS.window_len)
  drafter_fn = _drafter_fn()
  prompts = []
  if drafter_fn is not None and FLAGS.acceptance_prompts:
    from jaxspec.train import data as data_lib  # pylint: disable=import-outside-toplevel

    prompts = data_lib.function_prompts("validation", n=FLAGS.acceptance_prompts, seed=0)
  results, evaluator = profile_lib.profile(
    target, tokens, drafter_fn, prompts, FLAGS.max_new, progress=True
  )
  print(f"\n{model_dir}: {tokens.size} held-out tokens, perplexity {evaluator.ref_ppl:.3f}")
  print("\n".join(table(results)))
  rules, measured = profile_lib.choose_policy(results, evaluator, target, FLAGS.kl_budget)
  default = profile_lib.measure_policy(target, jaxspec.quant.DEFAULT_POLICY, evaluator)
  for name, r, m in (
    ("chosen", rules, measured),
    ("default", jaxspec.quant.DEFAULT_POLICY, default),
  ):
    m.update(profile_lib.policy_effect(target, r, drafter_fn, prompts, FLAGS.max_new))
    effect = ""
    if "greedy_match" in m:
      effect = f", greedy tokens equal to the full target's {m['greedy_match']:.1%}"
    if "tau_delta" in m:
      effect += f", Δτ {m['tau_delta']:+.1%} ({FLAGS.drafter})"
    print(
      f"\n{name} policy ({len(r)} rules): {m['bytes_before']:,} → {m['bytes_after']:,} bytes "
      f"({m['bytes_after'] / m['bytes_before']:.1%}), KL {m['kl']:.2e} (budget "
      f"{FLAGS.kl_budget:g}), top-1 {m['top1']:.1%}, Δppl {m['ppl_delta']:+.2%}{effect}"
    )
  policy_path = os.path.join(FLAGS.out, "policy.json")
  policy_lib.save_policy(rules, policy_path, kl_budget=FLAGS.kl_budget, measured=measured)
  with open(os.path.join(FLAGS.out, "profile.json"), "w") as f:
    json.dump(
      {
        "model": model_dir,
        "held_out_tokens": int(tokens.size),
        "perplexity": evaluator.ref_ppl,
        "groups": [dataclasses.asdict(r) for r in results],
        "chosen": {"rules": [list(r) for r in rules], **measured},
        "default": default,
      },
      f,
      indent=1,
    )
  png = plot(results, os.path.join(FLAGS.out, "sensitivity.png"))
  print(
    f"\npolicy: {policy_path}; profile: {FLAGS.out}/profile.json"
    + (f"; plot: {png}" if png else "")
  )
