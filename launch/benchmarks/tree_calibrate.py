"""Measures a drafter's sampled-tree acceptance model and writes it beside its checkpoint.

For each temperature, generates from training-split prompts (never the validation prompts the
generate bench reports on) with wide sampled trees (`tree_rule="recursive"`, --budget nodes,
the shape from the drafter's own q) and counts, per depth d, sibling rank r and bucket b of the
rank's sorted draft probability, how often the walk tried that child and how often it accepted
it (`SpecStats.tree_ranks`). a[d][r][b] = accepted / tried is the probability that rank r is
accepted once its depth is reached and the ranks before it were rejected; where fewer than
--min_tried tries were seen it is pooled over depths, then over ranks too (null if still
short). `tree_acceptance.json` (`jaxspec.io.tree_acceptance`) in --out_dir holds one table per
temperature, and `jaxspec.load_drafter` hands it to the tree builder. Usage:
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


def pooled_rates(tried: np.ndarray, accepted: np.ndarray, min_tried: int) -> np.ndarray:
  """[D, K, NB] accepted / tried, pooled over depths where an entry has fewer than
  `min_tried` tries, then over depths and ranks; NaN where even that is short."""
  levels = [
    (tried, accepted),
    (np.broadcast_to(tried.sum(0, keepdims=True), tried.shape),
     np.broadcast_to(accepted.sum(0, keepdims=True), tried.shape)),
    (np.broadcast_to(tried.sum((0, 1), keepdims=True), tried.shape),
     np.broadcast_to(accepted.sum((0, 1), keepdims=True), tried.shape)),
  ]
  rate = np.full(tried.shape, np.nan)
  for n, a in reversed(levels):  # finer levels overwrite coarser ones where they have data
    rate = np.where(n >= min_tried, a / np.maximum(n, 1), rate)
  return rate


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
    rate = pooled_rates(tried, accepted, FLAGS.min_tried)
    tables.append((t, rate, tried))
    print(f"T={t:g} ({time.perf_counter() - t0:.0f}s, {len(prompts)} prompts): a[depth][rank] "
          "over q buckets with tries (pooled where short)")
    for d in range(rate.shape[0]):
      for r in range(rate.shape[1]):
        seen = tried[d, r] > 0
        if seen.any():
          cells = " ".join(f"b{b}:{rate[d, r, b]:.2f}" for b in np.flatnonzero(seen))
          print(f"  depth {d + 1:2d} rank {r}: {cells}")
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
