"""The target's outputs stored once over a distillation set (jaxspec.train.target_cache)."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.errors import ConfigError
from jaxspec.models import target as target_lib
from jaxspec.train import distill, drafter_trainer, target_cache

TAPS = (1, 3)


@pytest.fixture(scope="module")
def built(target, tmp_path_factory):
  """A six-sequence distillation set of the bundled target and its cache (top k = V)."""
  root = tmp_path_factory.mktemp("cache")
  cfg = distill.DistillConfig(
    num_prompts=6, max_prompt_tokens=16, new_tokens=12, temperatures=(0.0,), batch_size=8
  )
  data_dir = distill.build(target, target.tokenizer, cfg, str(root / "d"))
  ccfg = target_cache.TargetCacheConfig(taps=TAPS, top_k=target.config.vocab_size, batch_size=4)
  return data_dir, ccfg, target_cache.build(target, data_dir, ccfg)


def test_the_cache_holds_the_targets_features_and_distribution(target, built):
  data_dir, _, cache_dir = built
  cache = target_cache.TargetCache(cache_dir)
  tokens = np.load(os.path.join(data_dir, "tokens.npy"))
  rows = np.array([4, 0, 2])  # any order: gathered rows come back in it
  got = cache.rows(rows)
  out = target_lib.forward(target.config, target.params, jnp.asarray(tokens[rows]), taps=TAPS)
  want_taps = np.asarray(jnp.moveaxis(out.taps, 0, 1).astype(jnp.bfloat16))
  np.testing.assert_allclose(
    got["taps"].astype(np.float32), want_taps.astype(np.float32), rtol=1e-2, atol=1e-2
  )
  logp = jax.nn.log_softmax(out.logits.astype(jnp.float32), axis=-1)
  top_logp, top_ids = jax.lax.top_k(logp, 5)
  np.testing.assert_array_equal(got["top_ids"][..., :5], np.asarray(top_ids))
  np.testing.assert_allclose(got["top_logp"][..., :5], np.asarray(top_logp), atol=2e-2, rtol=2e-3)
  assert cache.tap_index((3,)) == [1]
  with pytest.raises(ConfigError, match="not \\[2\\]"):
    cache.tap_index((1, 2))


def test_an_interrupted_build_resumes_and_a_changed_one_starts_over(target, built, tmp_path):
  data_dir, ccfg, cache_dir = built
  full = {f: np.array(a) for f, a in target_cache.TargetCache(cache_dir).arrays.items()}
  out = str(tmp_path / "c")
  target_cache.build(target, data_dir, ccfg, out)
  meta_path = os.path.join(out, "meta.json")
  with open(meta_path) as fh:
    meta = json.load(fh)
  # As if killed after the first batch: the rest of the rows never written.
  for f in target_cache.FILES:
    arr = np.load(os.path.join(out, f + ".npy"), mmap_mode="r+")
    arr[4:] = 0
    arr.flush()
  with open(meta_path, "w") as fh:
    json.dump(dict(meta, done=4), fh)
  with pytest.raises(ConfigError, match="incomplete"):
    target_cache.TargetCache(out)
  target_cache.build(target, data_dir, ccfg, out)
  resumed = target_cache.TargetCache(out)
  for f in target_cache.FILES:
    np.testing.assert_array_equal(np.array(resumed.arrays[f]), full[f])
  # Other settings in the same folder: built from the start, not resumed.
  other = target_cache.TargetCacheConfig(taps=(0,), top_k=4, batch_size=4)
  target_cache.build(target, data_dir, other, out)
  rebuilt = target_cache.TargetCache(out)
  assert rebuilt.taps == (0,) and rebuilt.arrays["top_ids"].shape[-1] == 4
  with pytest.raises(ConfigError, match="layers"):
    target_cache.build(target, data_dir, target_cache.TargetCacheConfig(taps=(9,)), out)


def test_a_drafter_trains_from_the_cache_as_from_the_target(target, built):
  """The loss of a batch read from the cache equals the loss with the target run in the step
  (features rounded to bfloat16 by the cache: close, not equal)."""
  data_dir, _, cache_dir = built
  cache = target_cache.TargetCache(cache_dir)
  ds = distill.DistillDataset(data_dir, 2, shuffle=False)
  cached = ds.with_cache(cache)
  from jaxspec.drafters.dflash import DFlashDrafter  # pylint: disable=import-outside-toplevel

  drafter = DFlashDrafter.random(
    target,
    num_layers=1,
    block_size=4,
    target_layer_ids=TAPS,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    intermediate_size=64,
  )
  tc = drafter_trainer.DrafterTrainConfig(num_anchors=4, soft_label_weight=0.5)
  frozen = drafter_trainer.frozen_inputs(drafter, target)
  key = jax.random.PRNGKey(0)
  plain = drafter_trainer.make_loss_fn(drafter, target, tc)
  from_cache = drafter_trainer.make_loss_fn(drafter, target, tc, cache_taps=cache.taps)
  batch = {k: jnp.asarray(v) for k, v in ds.batch_at(1).items()}
  cbatch = {k: jnp.asarray(v) for k, v in cached.batch_at(1).items()}
  np.testing.assert_array_equal(cbatch["tokens"], batch["tokens"])
  want, _ = jax.jit(plain)(drafter.params["draft"], frozen, batch, key)
  got, _ = jax.jit(from_cache)(drafter.params["draft"], frozen, cbatch, key)
  assert float(got) == pytest.approx(float(want), rel=2e-2)
  with pytest.raises(ConfigError, match="not \\[0\\]"):
    drafter_trainer.make_loss_fn(
      DFlashDrafter.random(target, num_layers=1, block_size=4, target_layer_ids=(0, 1)),
      target,
      tc,
      cache_taps=cache.taps,
    )
  with pytest.raises(ConfigError, match="another set"):
    distill.DistillDataset(data_dir, 2).with_cache(
      type("Fake", (), {"meta": {"rows": 99, "seq_len": ds.seq_len}})()
    )


def test_an_interrupted_distillation_resumes_to_the_same_rows(target, tmp_path, monkeypatch):
  """Killed after its first batch, a build continues from the saved rows and writes what an
  uninterrupted build writes (each batch's random stream is its own)."""
  from jaxspec.speculative.engine import SpecEngine  # pylint: disable=import-outside-toplevel

  cfg = distill.DistillConfig(
    num_prompts=6, max_prompt_tokens=16, new_tokens=8, temperatures=(1.0,), batch_size=4
  )
  whole = distill.build(target, target.tokenizer, cfg, str(tmp_path / "whole"))
  real, calls = SpecEngine.generate, []

  def dies_on_the_second_batch(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return real(self, *args, **kwargs)

  monkeypatch.setattr(SpecEngine, "generate", dies_on_the_second_batch)
  with pytest.raises(KeyboardInterrupt):
    distill.build(target, target.tokenizer, cfg, str(tmp_path / "cut"))
  assert os.path.exists(tmp_path / "cut" / "partial_0.npz")
  resumed = distill.build(target, target.tokenizer, cfg, str(tmp_path / "cut"))
  assert len(calls) == 3  # the first batch was not generated again
  assert not os.path.exists(tmp_path / "cut" / "partial_0.npz")
  for f in ("tokens", "lengths", "prompt_lens"):
    np.testing.assert_array_equal(
      np.load(os.path.join(resumed, f + ".npy")), np.load(os.path.join(whole, f + ".npy"))
    )


@pytest.mark.slow  # ~30 s: five distillation and cache builds
def test_a_grown_set_keeps_its_rows_and_extends_its_cache(target, tmp_path, monkeypatch):
  """More prompts of the same selection: only the new ones are continued, the kept rows come
  first unchanged, the set holds what a fresh build holds (greedy rows equal), and the cache
  of the smaller set is extended (its rows kept, only the new ones computed)."""
  tok = target.tokenizer
  small = distill.DistillConfig(
    num_prompts=2, max_prompt_tokens=16, new_tokens=6, temperatures=(0.0, 1.0), batch_size=2
  )
  big = dataclasses.replace(small, num_prompts=4)
  data = str(tmp_path / "d")
  distill.build(target, tok, small, data)
  before = {f: np.load(os.path.join(data, f + ".npy")) for f in distill._FILES}
  ccfg = target_cache.TargetCacheConfig(taps=TAPS, top_k=4, batch_size=2)
  cache_dir = target_cache.build(target, data, ccfg)
  old_cache = {f: np.array(a) for f, a in target_cache.TargetCache(cache_dir).arrays.items()}

  real_generate, continued = distill.generate, []
  monkeypatch.setattr(
    distill,
    "generate",
    lambda t, ids, *a, **k: continued.append(len(ids)) or real_generate(t, ids, *a, **k),
  )
  distill.build(target, tok, big, data)
  assert continued == [2, 2]  # the two new prompts, once per temperature
  after = {f: np.load(os.path.join(data, f + ".npy")) for f in distill._FILES}
  for f in distill._FILES:
    np.testing.assert_array_equal(after[f][:4], before[f])
  distill.build(target, tok, big, data)
  assert continued == [2, 2]  # reused as it is

  fresh = distill.build(
    target, tok, dataclasses.replace(big, temperatures=(0.0,)), str(tmp_path / "fresh")
  )
  want = np.load(os.path.join(fresh, "tokens.npy"))
  greedy = after["tokens"][after["temperature"] == 0]
  assert sorted(map(tuple, greedy)) == sorted(map(tuple, want))
  prompts = {tuple(r[:p]) for r, p in zip(after["tokens"], after["prompt_lens"])}
  assert len(prompts) == 4 and len(after["tokens"]) == 8

  real_forward, computed = target_cache._forward_fn, []

  def counting(*args):
    forward = real_forward(*args)
    return lambda params, tokens: computed.append(len(tokens)) or forward(params, tokens)

  monkeypatch.setattr(target_cache, "_forward_fn", counting)
  grown = target_cache.TargetCache(target_cache.build(target, data, ccfg))
  assert computed == [2, 2]  # rows 4-7 only
  for f, kept in old_cache.items():
    np.testing.assert_array_equal(grown.arrays[f][:4], kept)
  rebuilt = target_cache.build(target, data, ccfg, str(tmp_path / "whole"))
  for f, a in target_cache.TargetCache(rebuilt).arrays.items():
    np.testing.assert_array_equal(grown.arrays[f][4:], a[4:])
