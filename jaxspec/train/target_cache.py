"""The frozen target's outputs over a self-distillation set, computed once and stored on disk.

A drafter step needs the target's tapped features of every position (and, for EAGLE-3's loss
and DFlash's soft labels, its next-token distribution). Computing them inside each step runs
the whole target again for every epoch, every drafter and every evaluation; on a small machine
that is most of the cost of training a drafter for a real model (SmolLM2-135M: ~0.27 GFLOP a
token, most of a step). `build` runs the target once over a built distillation directory
(`jaxspec.train.distill`) in batches and stores, beside it:

- `taps.npy` [N, n_taps, S, H]: the outputs of the target layers `taps` (HF hidden_states[id +
  1], the ids drafters name), bfloat16 bits in uint16 (the format's numpy has no bfloat16);
- `top_ids.npy` int32 / `top_logp.npy` float16 [N, S, k]: the target's k most likely next
  tokens at every position and their log-probabilities (at T = 1). The soft labels are this
  distribution renormalised over its top k (with k = 16 the rest holds a few percent of the
  mass on real text), a truncation a [N, S, V] store (V = 49,152 for SmolLM2: 98 KB a token)
  cannot afford;
- `meta.json`: what was computed (taps, k, the distillation set's fingerprint) and how many
  rows are done, so an interrupted build resumes where it stopped, a set grown by
  `distill.build` (more prompts, appended) keeps the rows computed for the set it grew from, and
  a changed setting builds anew.

`TargetCache.rows(idx)` gathers the arrays of some sequences; `DistillDataset.with_cache`
attaches a cache so that its batches carry them, and the drafter trainer then reads the batch
instead of running the target (`drafter_trainer.make_loss_fn`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxspec.config import ModelConfig
from jaxspec.errors import ConfigError
from jaxspec.models import target as target_lib
from jaxspec.models.target import TargetModel
from jaxspec.train import distill

FILES = ("taps", "top_ids", "top_logp")


@dataclasses.dataclass(frozen=True)
class TargetCacheConfig:
  """What to store: the layers' outputs `taps` and the top `top_k` next tokens."""

  taps: tuple[int, ...]
  top_k: int = 16
  batch_size: int = 4

  def __post_init__(self):
    object.__setattr__(self, "taps", tuple(int(t) for t in self.taps))
    if not self.taps or len(set(self.taps)) != len(self.taps) or min(self.taps) < 0:
      raise ConfigError(f"taps must be distinct layer ids ≥ 0, got {self.taps}")
    if self.top_k < 1 or self.batch_size < 1:
      raise ConfigError(f"top_k and batch_size must be ≥ 1, got {self.top_k}, {self.batch_size}")


def _meta(distill_dir: str, cfg: TargetCacheConfig, shape: tuple[int, int]) -> dict:
  return {
    "taps": list(cfg.taps),
    "top_k": cfg.top_k,
    "distill": distill.set_fingerprint(distill_dir),
    "rows": shape[0],
    "seq_len": shape[1],
  }


def cache_dir_of(distill_dir: str, cfg: TargetCacheConfig) -> str:
  """Where the cache of these settings lives: a folder of the distillation directory."""
  taps = "-".join(str(t) for t in cfg.taps)
  return os.path.join(distill_dir, f"target_cache_taps{taps}_top{cfg.top_k}")


def full_sequence_config(config: ModelConfig) -> ModelConfig:
  """The target's config for full-sequence passes: on CPU the dense expert oracle is the
  fastest MoE backend there (same numbers)."""
  return config.with_options(moe_backend="dense") if config.num_experts else config


def target_features(
  target_config: ModelConfig,
  target_params: Any,
  tokens: jax.Array,
  taps: tuple[int, ...],
  logits: bool,
) -> tuple[jax.Array, jax.Array | None]:
  """The frozen target over full sequences: (taps [n, B, S, H], logits [B, S, V] or None)."""
  out = target_lib.apply_decoder(
    target_config, target_params, tokens, taps=taps, last_only=not logits
  )
  feats = jax.lax.stop_gradient(out.taps)
  return feats, (jax.lax.stop_gradient(out.logits) if logits else None)


def tap_positions(stored: Sequence[int], taps: Sequence[int]) -> list[int]:
  """Where each of a drafter's `taps` sits among the `stored` ones (ConfigError if missing)."""
  missing = [t for t in taps if t not in stored]
  if missing:
    raise ConfigError(f"the target cache stores taps {tuple(stored)}, not {missing}")
  return [list(stored).index(t) for t in taps]


def _forward_fn(target: TargetModel, taps: tuple[int, ...], top_k: int):
  config = full_sequence_config(target.config)

  @jax.jit
  def forward(params, tokens):
    feats, logits = target_features(config, params, tokens, taps, logits=True)
    feats = jnp.moveaxis(feats, 0, 1).astype(jnp.bfloat16)  # [B, n, S, H]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    top_logp, top_ids = jax.lax.top_k(logp, top_k)
    return jax.lax.bitcast_convert_type(feats, jnp.uint16), top_ids, top_logp.astype(jnp.float16)

  return forward


def build(
  target: TargetModel, distill_dir: str, cfg: TargetCacheConfig, out_dir: str | None = None
) -> str:
  """Computes (or resumes, or reuses) the cache of `distill_dir`; returns its directory."""
  out_dir = out_dir or cache_dir_of(distill_dir, cfg)
  tokens = np.load(os.path.join(distill_dir, "tokens.npy"), mmap_mode="r")
  lengths = np.load(os.path.join(distill_dir, "lengths.npy"))
  n, s = tokens.shape
  if max(cfg.taps) >= target.config.num_layers:
    raise ConfigError(
      f"taps {cfg.taps} name layers the {target.config.num_layers}-layer target lacks"
    )
  meta = _meta(distill_dir, cfg, (n, s))
  meta_path = os.path.join(out_dir, "meta.json")
  shapes = {
    "taps": ((n, len(cfg.taps), s, target.config.hidden_size), np.uint16),
    "top_ids": ((n, s, cfg.top_k), np.int32),
    "top_logp": ((n, s, cfg.top_k), np.float16),
  }
  done = 0
  if os.path.exists(meta_path):
    with open(meta_path, encoding="utf-8") as fh:
      old = json.load(fh)
    if all(old.get(k) == v for k, v in meta.items()):
      done = int(old.get("done", 0))
    else:
      done = _extend(out_dir, old, meta, distill_dir, shapes)
  os.makedirs(out_dir, exist_ok=True)
  mode = "r+" if done else "w+"
  arrays = {
    f: np.lib.format.open_memmap(os.path.join(out_dir, f + ".npy"), mode=mode, dtype=d, shape=sh)
    for f, (sh, d) in shapes.items()
  }
  if done >= n:
    logging.info("reusing the target cache in %s", out_dir)
    return out_dir
  forward = _forward_fn(target, cfg.taps, cfg.top_k)
  bsz, t0 = cfg.batch_size, time.time()
  for lo in range(done, n, bsz):
    idx = np.arange(lo, lo + bsz) % n  # the last batch padded with copies: one compilation
    # Only up to the longest sequence of the batch, rounded up to 64 (few compiled widths).
    width = min(s, -(-int(lengths[idx].max()) // 64) * 64)
    feats, ids, logp = forward(target.params, jnp.asarray(tokens[idx, :width]))
    keep = min(bsz, n - lo)
    arrays["taps"][lo : lo + keep, :, :width] = np.asarray(feats)[:keep]
    arrays["top_ids"][lo : lo + keep, :width] = np.asarray(ids)[:keep]
    arrays["top_logp"][lo : lo + keep, :width] = np.asarray(logp)[:keep]
    if (lo // bsz) % 16 == 15 or lo + keep >= n:
      for a in arrays.values():
        a.flush()
      _write_meta(meta_path, dict(meta, done=lo + keep))
      rate = (lo + keep - done) / max(time.time() - t0, 1e-9)
      logging.info("target cache: %d / %d sequences (%.2f per s)", lo + keep, n, rate)
  return out_dir


def _extend(out_dir: str, old: dict, meta: dict, distill_dir: str, shapes: dict) -> int:
  """Rows of the cache in `out_dir` (meta `old`) kept for `distill_dir`, which grew from the
  set it was built for (`distill.build`: its rows come first, unchanged): its arrays are copied
  into ones of the new size and its done rows kept; 0 (build anew) for any other set."""
  with open(os.path.join(distill_dir, "meta.json"), encoding="utf-8") as fh:
    lineage = json.load(fh).get("grown_from", [])
  rows = next((g["rows"] for g in lineage if g["meta_sha256"] == old.get("distill")), None)
  same = all(old.get(k) == meta[k] for k in ("taps", "top_k", "seq_len"))
  if rows is None or not same or old.get("rows") != rows or rows > meta["rows"]:
    return 0
  if not all(os.path.exists(os.path.join(out_dir, f + ".npy")) for f in shapes):
    return 0
  done = min(int(old.get("done", 0)), rows)
  for f, (shape, dtype) in shapes.items():
    path = os.path.join(out_dir, f + ".npy")
    kept = np.load(path, mmap_mode="r")
    if kept.shape == shape:  # extended already (a run stopped between two arrays)
      continue
    tmp = path + ".grow.npy"
    grown = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=shape)
    for lo in range(0, done, 256):
      grown[lo : min(done, lo + 256)] = kept[lo : min(done, lo + 256)]
    grown.flush()
    del grown, kept
    os.replace(tmp, path)
  _write_meta(os.path.join(out_dir, "meta.json"), dict(meta, done=done))
  logging.info("target cache: kept %d rows of the set this one grew from", done)
  return done


def _write_meta(path: str, meta: dict) -> None:
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as fh:
    json.dump(meta, fh, indent=2)
  os.replace(tmp, path)


class TargetCache:
  """A built cache, memory-mapped: `rows(idx)` gathers its arrays for some sequences."""

  def __init__(self, out_dir: str):
    with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as fh:
      self.meta = json.load(fh)
    if self.meta.get("done", 0) < self.meta["rows"]:
      raise ConfigError(
        f"the target cache in {out_dir} is incomplete ({self.meta.get('done', 0)} of "
        f"{self.meta['rows']} sequences): run target_cache.build to finish it"
      )
    self.taps = tuple(self.meta["taps"])
    self.arrays = {f: np.load(os.path.join(out_dir, f + ".npy"), mmap_mode="r") for f in FILES}

  def tap_index(self, taps: Sequence[int]) -> list[int]:
    """Positions of a drafter's taps among the stored ones (ConfigError if one is missing)."""
    return tap_positions(self.taps, taps)

  def rows(self, idx: np.ndarray) -> dict[str, np.ndarray]:
    """{"taps" bfloat16 [B, n_taps, S, H], "top_ids" [B, S, k], "top_logp" float32 [B, S, k]}."""
    order = np.argsort(idx)  # sorted reads from the memory map, then back to idx's order
    back = np.argsort(order)
    got = {f: np.asarray(a[np.asarray(idx)[order]])[back] for f, a in self.arrays.items()}
    got["taps"] = got["taps"].view(jnp.bfloat16)
    got["top_logp"] = got["top_logp"].astype(np.float32)
    return got


def sparse_probs(top_ids: jax.Array, top_logp: jax.Array) -> jax.Array:
  """The stored top-k distribution renormalised over its k tokens: probabilities [..., k]."""
  del top_ids  # the ids say where the mass sits, not how much
  return jax.nn.softmax(top_logp.astype(jnp.float32), axis=-1)
