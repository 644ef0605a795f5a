"""Self-distillation data for drafters: the target's own continuations, stored on disk.

A drafter is judged by how often the *target* agrees with it, so it is trained on what the
target writes (DFlash, EAGLE-3 and Medusa all train on target-generated responses). Prompts
(`DistillConfig.prompts`) are either function openings of one corpus split
(`data.function_prompts`, "functions": for code models), cut to their last `max_prompt_tokens`
tokens, or chat requests of the instruction mix (`instructions`, "instructions": for chat
models), rendered with the tokenizer's chat template and kept whole (the excerpt inside is cut to
fit instead; replies also stop at the template's end-of-turn token). Each is continued by the
target for `new_tokens` tokens once per entry of `temperatures` (0 = greedy) with jaxspec's
on-device plain decoding, in padded batches.

On disk (`out_dir`): `tokens.npy` [N, P + G] int32 (prompt, continuation, then pad), `lengths.npy`
and `prompt_lens.npy` [N] int32, `temperature.npy` [N] float32 and `meta.json`, which records
the settings and a fingerprint of the target weights and tokenizer; `build` reuses a directory
whose meta matches, grows one that asks for fewer prompts of the same selection (only the new
prompts are continued), and rebuilds otherwise. Supervised positions (`loss_mask`) are the generated
tokens only: the drafter learns the target's continuations, never the corpus text of the prompt.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import os
import tempfile
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from absl import logging

from jaxspec.errors import ConfigError
from jaxspec.models.target import TargetModel
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.train import data as data_lib
from jaxspec.train import instructions

_FILES = ("tokens", "lengths", "prompt_lens", "temperature")
PROMPT_KINDS = ("functions", "instructions")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """What to generate: `len(temperatures)` continuations of each prompt."""

  split: str = data_lib.TRAIN
  num_prompts: int = 0  # 0: every function opening of the split
  max_prompt_tokens: int = 64
  new_tokens: int = 192
  temperatures: tuple[float, ...] = (0.0, 1.0)
  batch_size: int = 64
  seed: int = 0
  corpus_root: str = ""  # "": the standard library
  prompts: str = "functions"  # or "instructions" (PROMPT_KINDS)

  def __post_init__(self):
    if self.prompts not in PROMPT_KINDS:
      raise ConfigError(f"prompts must be one of {PROMPT_KINDS}, got {self.prompts!r}")
    object.__setattr__(self, "temperatures", tuple(float(t) for t in self.temperatures))
    if not self.temperatures or any(t < 0 for t in self.temperatures):
      raise ConfigError(
        f"temperatures must be a non-empty list of values ≥ 0, got {self.temperatures}"
      )
    if self.max_prompt_tokens < 1 or self.new_tokens < 2 or self.batch_size < 1:
      raise ConfigError("max_prompt_tokens ≥ 1, new_tokens ≥ 2 and batch_size ≥ 1 are required")

  @property
  def seq_len(self) -> int:
    return self.max_prompt_tokens + self.new_tokens

  @classmethod
  def from_mapping(cls, m: Any) -> "DistillConfig":
    d = dict(m)
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ConfigError(f"unknown distillation setting(s) {unknown}")
    if "temperatures" in d:
      d["temperatures"] = tuple(d["temperatures"])
    return cls(**d)


def params_fingerprint(params: Any) -> str:
  """sha256 over the parameter leaves (paths, shapes, dtypes and bytes)."""
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    arr = np.asarray(leaf)
    h.update(f"{jax.tree_util.keystr(path)}:{arr.shape}:{arr.dtype};".encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()


def encode_prompts(tokenizer: Any, prompts: Sequence[str], max_tokens: int) -> list[list[int]]:
  """Token ids of each prompt, keeping the last `max_tokens` (the text nearest the cursor)."""
  return [ids[-max_tokens:] for ids in tokenizer.encode_batch(list(prompts))]


def _meta(target: TargetModel, tokenizer: Any, cfg: DistillConfig, ids: Sequence[Sequence[int]]):
  config = dataclasses.asdict(cfg)
  meta = {
    "config": config,
    "target": params_fingerprint(target.params),
    "tokenizer": tokenizer.fingerprint,
    "num_prompts": len(ids),
  }
  if cfg.prompts == "functions":
    del config["prompts"]  # the default leaves the meta of datasets built before it unchanged
  else:  # the mix depends on the text installed here: fingerprint what it gave
    meta["prompt_ids"] = hashlib.sha256(json.dumps([list(x) for x in ids]).encode()).hexdigest()
  return meta


def set_fingerprint(out_dir: str) -> str:
  """A built set's identity: the sha256 of its meta.json (settings, target and tokenizer
  hashes, the sets it grew from). `target_cache` keys a cache by it; `grown_from` names a set's
  ancestors by it."""
  with open(os.path.join(out_dir, "meta.json"), "rb") as fh:
    return _sha256(fh.read())


def _sha256(data: bytes) -> str:
  return hashlib.sha256(data).hexdigest()


def _stored(out_dir: str) -> tuple[dict, str] | None:
  """The complete set in `out_dir`: (its meta, its `set_fingerprint`); None if there is none."""
  path = os.path.join(out_dir, "meta.json")
  if not os.path.exists(path) or not all(
    os.path.exists(os.path.join(out_dir, f + ".npy")) for f in _FILES
  ):
    return None
  with open(path, "rb") as fh:
    raw = fh.read()
  return json.loads(raw), _sha256(raw)


def _matches(stored: tuple[dict, str] | None, meta: dict) -> bool:
  if stored is None:
    return False
  keys = ("config", "target", "tokenizer", "num_prompts", "prompt_ids")
  return all(stored[0].get(k) == json.loads(json.dumps(meta.get(k))) for k in keys)


def generate(
  target: TargetModel,
  prompt_ids: Sequence[Sequence[int]],
  cfg: DistillConfig,
  temperature: float,
  seed: int,
  stop_ids: Sequence[int] = (),
  progress: tuple[str, str] | None = None,
  first_row: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Continues every prompt once: (tokens [N, P+G], lengths [N], prompt_lens [N]).

  Runs in padded batches of cfg.batch_size (the last batch is padded with copies, dropped),
  so the decoding loop compiles once. With `progress` = (path, key) the rows done so far are
  saved to path after every batch and a run with the same key resumes from them: batch b's
  random stream depends on (seed, first_row + its first row) alone, so a resumed run writes
  what an uninterrupted one would (`first_row`: where these prompts start in a set they grow,
  so that their streams are not those of the rows already there).
  """
  p, seq = cfg.max_prompt_tokens, cfg.seq_len
  n = len(prompt_ids)
  bsz = cfg.batch_size
  tokens = np.zeros((n, seq), np.int32)
  lengths = np.zeros((n,), np.int32)
  plens = np.array([len(x) for x in prompt_ids], np.int32)
  if np.any(plens < 1):
    raise ConfigError("every prompt needs at least one token")
  # Plain decoding is the engine without a drafter; one more slot than the rows hold because
  # the engine keeps room for the token after the last one it commits.
  engine = SpecEngine(
    target,
    None,
    EngineConfig(
      max_len=seq + 1,
      batch_size=bsz,
      min_prompt_bucket=p,
      stop_ids=tuple(stop_ids),
      use_eos=False,
    ),
  )
  start = 0
  if first_row < 0:
    raise ConfigError(f"first_row must be ≥ 0, got {first_row}")
  if progress is not None and os.path.exists(progress[0]):
    with np.load(progress[0]) as saved:
      if str(saved["key"]) == progress[1] and saved["tokens"].shape == tokens.shape:
        start = int(saved["done"])
        tokens[:start], lengths[:start] = saved["tokens"][:start], saved["lengths"][:start]
        logging.info("distill: resuming at T=%g from %d of %d rows", temperature, start, n)
  for lo in range(start, n, bsz):
    idx = np.arange(lo, lo + bsz) % n
    out = engine.generate(
      [prompt_ids[i] for i in idx],
      max_new_tokens=cfg.new_tokens,
      temperature=temperature,
      seed=seed * 100_003 + first_row + lo,
    )
    for r in range(min(bsz, n - lo)):
      row = list(prompt_ids[idx[r]]) + out.tokens[r]
      tokens[lo + r, : len(row)] = row
      lengths[lo + r] = len(row)
    if progress is not None:
      done = min(n, lo + bsz)
      _atomic_write(
        progress[0],
        lambda fh: np.savez(fh, key=progress[1], done=done, tokens=tokens, lengths=lengths),
      )
    logging.info("distill: %d / %d rows at T=%g", min(n, lo + bsz), n, temperature)
  return tokens, lengths, plens


def prompt_ids(
  target: TargetModel, tokenizer: Any, cfg: DistillConfig
) -> tuple[list[list[int]], list[int]]:
  """(token ids of each prompt, ids that stop a continuation) for `cfg.prompts`."""
  n = cfg.num_prompts or None
  if cfg.prompts == "instructions":
    ids = instructions.distill_prompt_ids(
      tokenizer, cfg.split, n, cfg.seed, cfg.max_prompt_tokens, stdlib_root=cfg.corpus_root or None
    )
    stop = instructions.chat_stop_ids(tokenizer, target.config.eos_token_ids or ())
  else:
    texts = data_lib.function_prompts(cfg.split, n=n, seed=cfg.seed, root=cfg.corpus_root or None)
    ids = encode_prompts(tokenizer, texts, cfg.max_prompt_tokens)
    stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
  if not ids:
    raise ConfigError(f"split {cfg.split!r} gives no {cfg.prompts} prompts")
  return ids, stop


def _grown_set(
  out_dir: str, stored: tuple[dict, str] | None, meta: dict, ids: Sequence[Sequence[int]]
) -> dict | None:
  """The set `stored` in `out_dir`, if `meta` only asks for more prompts of the same selection:
  {"arrays": its arrays, "meta": its meta, "sha": its fingerprint, "added": the prompts of `ids`
  it lacks}; None when it must be built anew (other settings, target or tokenizer, or a prompt
  it holds that the new selection does not)."""
  if stored is None:
    return None
  old, sha = stored
  new = json.loads(json.dumps(meta))
  same = {k: v for k, v in new["config"].items() if k != "num_prompts"}
  if old.get("target") != new["target"] or old.get("tokenizer") != new["tokenizer"]:
    return None
  if {k: v for k, v in old.get("config", {}).items() if k != "num_prompts"} != same:
    return None
  arrays = {f: np.load(os.path.join(out_dir, f + ".npy")) for f in _FILES}
  held = {
    tuple(int(t) for t in row[:plen]) for row, plen in zip(arrays["tokens"], arrays["prompt_lens"])
  }
  wanted = [tuple(int(t) for t in x) for x in ids]
  if not held <= set(wanted):
    return None
  added = [list(x) for x in dict.fromkeys(wanted) if x not in held]
  return {"arrays": arrays, "meta": old, "sha": sha, "added": added, "held": len(held)}


def build(
  target: TargetModel, tokenizer: Any, cfg: DistillConfig, out_dir: str, force: bool = False
) -> str:
  """Generates the dataset into out_dir (reusing a matching one); returns out_dir.

  A set built with fewer prompts of the same selection (only `num_prompts` differs, and the new
  selection holds every prompt it has: the selections only add prompts as n grows) is grown:
  only the prompts it lacks are continued, their rows appended after the ones kept, and
  meta.json's `grown_from` lists the sets it grew from (their meta.json hashes and row counts),
  so that `target_cache.build` extends a cache of one of them instead of starting over.
  """
  ids, stop = prompt_ids(target, tokenizer, cfg)
  meta = _meta(target, tokenizer, cfg, ids)
  stored = None if force else _stored(out_dir)
  if _matches(stored, meta):
    logging.info("reusing the distillation data in %s", out_dir)
    return out_dir
  base = _grown_set(out_dir, stored, meta, ids)
  todo = ids if base is None else base["added"]
  pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
  parts: dict[str, list[np.ndarray]] = {f: [] for f in _FILES}
  if base is not None:
    logging.info(
      "distill: growing %s: keeping its %d prompts, continuing %d more",
      out_dir,
      base["held"],
      len(todo),
    )
    for f in _FILES:
      parts[f].append(base["arrays"][f])
  t0 = time.time()
  os.makedirs(out_dir, exist_ok=True)
  key = hashlib.sha256(
    json.dumps([meta, base and base["sha"]], sort_keys=True).encode()
  ).hexdigest()
  partial = [os.path.join(out_dir, f"partial_{j}.npz") for j in range(len(cfg.temperatures))]
  first_row = 0 if base is None else base["held"]
  for j, temp in enumerate(cfg.temperatures if todo else ()):
    toks, lens, plens = generate(
      target,
      todo,
      cfg,
      temp,
      seed=cfg.seed * 1000 + j,
      stop_ids=stop,
      progress=(partial[j], key),
      first_row=first_row,
    )
    toks = np.where(np.arange(cfg.seq_len)[None] < lens[:, None], toks, pad).astype(np.int32)
    for f, v in zip(_FILES, (toks, lens, plens, np.full(len(todo), temp, np.float32))):
      parts[f].append(v)
    logging.info(
      "distill: %d continuations at T=%g (%.0f s so far)", len(todo), temp, time.time() - t0
    )
  for f in _FILES:
    whole = np.concatenate(parts[f])
    _atomic_write(os.path.join(out_dir, f + ".npy"), lambda fh: np.save(fh, whole))
  meta["generated_tokens"] = int(
    sum(int(np.sum(l - p)) for l, p in zip(parts["lengths"], parts["prompt_lens"]))
  )
  meta["seconds"] = time.time() - t0 + (0 if base is None else base["meta"].get("seconds", 0))
  if base is not None:
    rows = len(base["arrays"]["lengths"])
    meta["grown_from"] = base["meta"].get("grown_from", []) + [
      {"meta_sha256": base["sha"], "rows": rows}
    ]
  with open(os.path.join(out_dir, "meta.json"), "w", encoding="utf-8") as fh:
    json.dump(meta, fh, indent=2)
  for path in partial:
    if os.path.exists(path):
      os.remove(path)
  return out_dir


def _atomic_write(path: str, write: Callable[[Any], None]) -> None:
  """write(file) into `path`, which readers see whole or not at all."""
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  with os.fdopen(fd, "wb") as fh:
    write(fh)
  os.replace(tmp, path)


class DistillDataset:
  """Deterministic, resumable batches {"tokens" [B, S], "loss_mask" [B, S]} of a built dataset.

  Epoch e visits the sequences in the order `np.random.default_rng([seed, e]).permutation`;
  `batch_at(step)` is a pure function of the step (resuming reproduces the batches).
  """

  def __init__(self, out_dir: str, batch_size: int, seed: int = 0, shuffle: bool = True):
    arrays = {f: np.load(os.path.join(out_dir, f + ".npy")) for f in _FILES}
    self.tokens = arrays["tokens"]
    pos = np.arange(self.tokens.shape[1])[None]
    self.loss_mask = (pos >= arrays["prompt_lens"][:, None]) & (pos < arrays["lengths"][:, None])
    self.temperature = arrays["temperature"]
    self.batch_size = int(batch_size)
    self.seed = int(seed)
    self.shuffle = shuffle
    self.batches_per_epoch = len(self.tokens) // self.batch_size
    if self.batches_per_epoch == 0:
      raise ConfigError(f"{len(self.tokens)} sequences are too few for a batch of {batch_size}")
    self.cache: Any = None  # a target_cache.TargetCache: its arrays join every batch
    self.cache_rows = np.arange(len(self.tokens))  # each local row's row in the cache

  def with_cache(self, cache: Any) -> "DistillDataset":
    """This dataset whose batches also carry the target's stored outputs (`target_cache`)."""
    if cache.meta["rows"] != len(self.tokens) or cache.meta["seq_len"] != self.seq_len:
      raise ConfigError(
        f"the target cache holds {cache.meta['rows']} × {cache.meta['seq_len']} positions, "
        f"the dataset {len(self.tokens)} × {self.seq_len}: it was built for another set"
      )
    out = copy.copy(self)
    out.cache = cache
    return out

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  @property
  def num_supervised(self) -> int:
    return int(self.loss_mask.sum())

  def by_temperature(self) -> dict[float, "DistillDataset"]:
    """Unshuffled views of the rows of each sampling temperature that fill a batch."""
    views = {}
    for t in np.unique(self.temperature):
      rows = np.flatnonzero(self.temperature == t)
      if len(rows) < self.batch_size:
        continue
      view = copy.copy(self)
      view.tokens, view.loss_mask = self.tokens[rows], self.loss_mask[rows]
      view.temperature, view.shuffle = self.temperature[rows], False
      view.cache_rows = self.cache_rows[rows]
      view.batches_per_epoch = len(rows) // self.batch_size
      views[float(t)] = view
    return views

  def batch_at(self, step: int) -> dict[str, np.ndarray]:
    epoch, i = divmod(step, self.batches_per_epoch)
    order = (
      np.random.default_rng([self.seed, epoch]).permutation(len(self.tokens))
      if self.shuffle
      else np.arange(len(self.tokens))
    )
    rows = order[i * self.batch_size : (i + 1) * self.batch_size]
    batch = {"tokens": self.tokens[rows], "loss_mask": self.loss_mask[rows]}
    if self.cache is not None:
      batch.update(self.cache.rows(self.cache_rows[rows]))
    return batch
