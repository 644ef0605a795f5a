"""Measures a drafter's sampled-tree acceptance model and writes it beside its checkpoint.

For each temperature, generates from training-split prompts (never the validation prompts the
generate bench reports on) with wide sampled trees (`tree_rule="recursive"`, --budget nodes,
the shape from the drafter's own q) and counts, per depth d and sibling rank r, how often the
walk tried that child and how often it accepted it (`SpecStats.tree_ranks`). a[d][r] =
accepted / tried where at least --min_tried tries were seen (null elsewhere) is the
probability that rank r is accepted once its depth is reached and the ranks before it were
rejected; `tree_acceptance.json` (`jaxspec.io.tree_acceptance`) in --out_dir holds one table
per temperature, and `jaxspec.load_drafter` hands it to the tree builder. Usage:
python launch/bench.py tree-calibrate [--method=dflash] [--drafter=DIR] [--out_dir=DIR]
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import numpy as np
from absl import flags

import jaxspec
from jaxspec.drafters import registry
from jaxspec.io import tree_acceptance
from jaxspec.train import data

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string("method", "dflash", "drafter kind (a tree-capable one)")
  flags.DEFINE_string("drafter", None, "drafter checkpoint directory (default: the bundled one)")
  flags.DEFINE_string("model", None, "target directory (default: the bundled target)")
  flags.DEFINE_string("out_dir", None, "where tree_acceptance.json goes (default: --drafter)")
  flags.DEFINE_list("calibrate_temperatures", ["0.6", "1"], "temperatures to measure (> 0)")
  flags.DEFINE_integer("budget", 48, "tree budget while measuring (wide: many ranks tried)")
  flags.DEFINE_integer("num_prompts", 64, "training-split prompts")
  flags.DEFINE_integer("max_new_tokens", 128, "tokens generated per prompt")
  flags.DEFINE_integer("min_tried", 20, "tries below which an entry is left unmeasured")
  flags.DEFINE_integer("seed", 0, "prompt selection and sampling seed")


def measure(engine: jaxspec.SpecEngine, prompts, temperature: float, new: int, seed: int):
  """(tried, accepted) [D, K] summed over the prompts, one generate per prompt."""
  tried = accepted = 0
  for i, p in enumerate(prompts):
    out = engine.generate([p], max_new_tokens=new, temperature=temperature, seed=seed + i)
    tried = tried + np.asarray(out.stats.summary["tree_rank_tried"])
    accepted = accepted + np.asarray(out.stats.summary["tree_rank_accepted"])
  return tried, accepted


def main(argv: Sequence[str]) -> None:
  del argv
  model_dir = FLAGS.model or registry.bundled_dir("target")
  drafter_dir = FLAGS.drafter or registry.bundled_dir(FLAGS.method)
  if model_dir is None or drafter_dir is None:
    raise SystemExit("no target or drafter: pass --model and --drafter")
  target = jaxspec.load_model(model_dir, scan_layers=False)
  drafter = registry.make_drafter(FLAGS.method, target, draft_dir=drafter_dir)
  drafter = dataclasses.replace(drafter, tree_acceptance=None)  # shape from the drafter's q
  texts = data.function_prompts(split=data.TRAIN, n=FLAGS.num_prompts, seed=FLAGS.seed)
  prompts = [target.tokenizer.encode(t) for t in texts]
  max_len = -(-(max(map(len, prompts)) + FLAGS.max_new_tokens + FLAGS.budget + 1) // 64) * 64
  config = jaxspec.EngineConfig(
    max_len=max_len,
    use_eos=False,
    verify="tree",
    tree_budget=FLAGS.budget,
    tree_rule="recursive",
  )
  engine = jaxspec.SpecEngine(target, drafter, config)
  tables = []
  for t in map(float, FLAGS.calibrate_temperatures):
    t0 = time.perf_counter()
    tried, accepted = measure(engine, prompts, t, FLAGS.max_new_tokens, FLAGS.seed)
    with np.errstate(divide="ignore", invalid="ignore"):
      rate = np.where(tried >= FLAGS.min_tried, accepted / np.maximum(tried, 1), np.nan)
    tables.append((t, rate, tried))
    print(f"T={t:g} ({time.perf_counter() - t0:.0f}s, {len(prompts)} prompts): a[depth][rank]")
    for d, row in enumerate(rate):
      cells = ("  -  " if np.isnan(a) else f"{a:.3f}" for a in row)
      print(f"  depth {d + 1:2d}: " + " ".join(cells))
  path = tree_acceptance.write(
    FLAGS.out_dir or drafter_dir,
    tables,
    target=os.path.relpath(model_dir, os.path.dirname(drafter_dir)),
    method=FLAGS.method,
    budget=FLAGS.budget,
    prompts=f"{len(prompts)} training-split function openings, seed {FLAGS.seed}",
    max_new_tokens=FLAGS.max_new_tokens,
  )
  print(f"wrote {path}")
