"""Self-distillation data and drafter training (DFlash, EAGLE-3) on a tiny random target."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxspec

from configs import tiny_code
from jaxspec.drafters import registry
from jaxspec.drafters.base import PrefillContext
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.train import distill, drafter_trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# `target`: the bundled one (conftest.py); a random one's continuations carry nothing a few
# steps can learn.


@pytest.fixture(scope="module")
def datasets(target, tmp_path_factory):
  config = tiny_code.get_config("test_dflash")
  root = tmp_path_factory.mktemp("distill")
  train_dir = distill.build(
    target, target.tokenizer, distill.DistillConfig.from_mapping(config.distill), str(root / "t")
  )
  val_dir = distill.build(
    target,
    target.tokenizer,
    distill.DistillConfig.from_mapping(config.val_distill),
    str(root / "v"),
  )
  return train_dir, val_dir


def test_warm_start_keeps_the_weights_and_takes_the_new_taps(target):
  config = tiny_code.get_config("test_eagle3")
  counts = np.arange(target.config.vocab_size)
  fresh = drafter_trainer.init_drafter("eagle3", target, config.drafter, counts)
  spec = dict(config.drafter, target_layer_ids=(1, 2, 3), seed=5)
  init = drafter_trainer.init_drafter("eagle3", target, spec, counts[::-1].copy())
  started = drafter_trainer.warm_start(fresh, init)
  assert started.taps == fresh.taps != init.taps
  for a, b in zip(
    jax.tree_util.tree_leaves(started.params), jax.tree_util.tree_leaves(init.params)
  ):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  wider = drafter_trainer.init_drafter("eagle3", target, dict(spec, intermediate_size=32), counts)
  with pytest.raises(jaxspec.ConfigError, match="warm start: parameter"):
    drafter_trainer.warm_start(fresh, wider)
  dflash = drafter_trainer.init_drafter(
    "dflash", target, tiny_code.get_config("test_dflash").drafter
  )
  with pytest.raises(jaxspec.ConfigError, match="cannot warm-start"):
    drafter_trainer.warm_start(fresh, dflash)


def test_a_dflash_drafter_grows_deeper_computing_the_same_drafts(target):
  spec = tiny_code.get_config("test_dflash").drafter
  init = drafter_trainer.init_drafter("dflash", target, dict(spec, seed=3))
  fresh = drafter_trainer.init_drafter("dflash", target, dict(spec, num_layers=3))
  grown = drafter_trainer.warm_start(fresh, init)
  assert grown.config.num_layers == 3 and len(grown.config.layer_windows) == 3
  want = {k: v.shape for k, v in drafter_trainer._leaves(fresh.params)}
  assert {k: v.shape for k, v in drafter_trainer._leaves(grown.params)} == want
  # Every layer of the initial drafter is kept; the added ones start as the identity.
  for name, leaf in init.params["draft"].items():
    for a, b in zip(
      jax.tree_util.tree_leaves(leaf), jax.tree_util.tree_leaves(grown.params["draft"][name])
    ):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  added = grown.params["draft"]["layers_2"]
  assert not np.any(np.asarray(added["self_attn"]["o_proj"]["kernel"]))
  assert np.any(np.asarray(added["self_attn"]["q_proj"]["kernel"]))
  # Same block logits as the shallower drafter, from the same context.
  rng = np.random.default_rng(0)
  s, h = 12, target.config.hidden_size
  taps = jax.numpy.asarray(rng.normal(size=(len(init.taps), 1, s, h)), jax.numpy.float32)
  tokens = jax.numpy.asarray(rng.integers(3, 100, (1, s)), jax.numpy.int32)
  block = jax.numpy.asarray([[5] + [init.config.mask_token_id] * (init.config.block_size - 1)])
  ctx = PrefillContext(tokens, jax.numpy.array([s]), taps, taps[0])
  logits = []
  for d in (init, grown):
    st = d.prefill(d.params, d.init_state(d.params, 1, 2 * s), ctx)
    logits.append(np.asarray(d.block_logits(d.params, st, block, jax.numpy.array([s]))))
  np.testing.assert_allclose(logits[1], logits[0], atol=1e-6)
  with pytest.raises(jaxspec.ConfigError, match="warm start: parameter"):
    drafter_trainer.warm_start(init, fresh)  # shrinking is not growing


def test_distillation_rows_are_the_targets_own_continuations(target, datasets):
  train_dir, _ = datasets
  cfg = distill.DistillConfig.from_mapping(tiny_code.get_config("test_dflash").distill)
  ds = distill.DistillDataset(train_dir, batch_size=4, shuffle=False)
  temps = ds.temperature
  assert len(ds.tokens) == cfg.num_prompts * len(cfg.temperatures)
  np.testing.assert_array_equal(temps, np.repeat(cfg.temperatures, cfg.num_prompts))
  plens = np.load(os.path.join(train_dir, "prompt_lens.npy"))
  lengths = np.load(os.path.join(train_dir, "lengths.npy"))
  assert np.all(plens <= cfg.max_prompt_tokens) and np.all(lengths <= cfg.seq_len)
  # The loss mask covers exactly the generated tokens.
  np.testing.assert_array_equal(ds.loss_mask.sum(1), lengths - plens)
  # A greedy row is the target's own greedy continuation of its prompt, token for token.
  row = 0
  prompt = ds.tokens[row, : plens[row]]
  engine_cfg = EngineConfig(
    max_len=len(prompt) + cfg.new_tokens + 1, batch_size=1, use_eos=False, stop_ids=(0,)
  )
  out = SpecEngine(target, None, engine_cfg).generate(
    [prompt], max_new_tokens=cfg.new_tokens, temperature=0.0
  )
  want = np.concatenate([prompt, np.asarray(out.tokens[0], np.int32)])
  np.testing.assert_array_equal(ds.tokens[row, : lengths[row]], want)
  # Sampled rows differ from the greedy ones somewhere (temperature 1 is really sampled).
  n = cfg.num_prompts
  assert np.any(ds.tokens[:n] != ds.tokens[n:])
  # Batches are a pure function of the step; epochs reshuffle.
  shuffled = distill.DistillDataset(train_dir, batch_size=4, seed=3)
  np.testing.assert_array_equal(shuffled.batch_at(5)["tokens"], shuffled.batch_at(5)["tokens"])
  assert not np.array_equal(shuffled.batch_at(0)["tokens"], shuffled.batch_at(4)["tokens"])


def test_distillation_is_reused_only_for_the_same_target(target, datasets, tmp_path):
  train_dir, _ = datasets
  cfg = distill.DistillConfig.from_mapping(tiny_code.get_config("test_dflash").distill)
  stamp = os.path.getmtime(os.path.join(train_dir, "tokens.npy"))
  distill.build(target, target.tokenizer, cfg, train_dir)
  assert os.path.getmtime(os.path.join(train_dir, "tokens.npy")) == stamp
  other = dataclasses.replace(
    target, params=jax.tree_util.tree_map(lambda x: x * 1.5, target.params)
  )
  meta = json.load(open(os.path.join(train_dir, "meta.json")))
  out = str(tmp_path / "d")
  distill.build(other, target.tokenizer, cfg, out)
  assert json.load(open(os.path.join(out, "meta.json")))["target"] != meta["target"]


class _Interrupt(Exception):
  pass


class _StopAt:
  """A dataset that raises when asked for step `stop` (an interrupted run)."""

  def __init__(self, ds, stop):
    self._ds, self._stop = ds, stop

  def __getattr__(self, name):
    return getattr(self._ds, name)

  def batch_at(self, step):
    if step == self._stop:
      raise _Interrupt()
    return self._ds.batch_at(step)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["dflash", "eagle3"])
def test_training_lowers_the_loss_and_resumes_exactly(method, target, datasets, tmp_path):
  train_dir, val_dir = datasets
  config = tiny_code.get_config(f"test_{method}")
  tc = drafter_trainer.DrafterTrainConfig.from_mapping(config.train.to_dict())
  train_ds = distill.DistillDataset(train_dir, tc.batch_size)
  val_ds = distill.DistillDataset(val_dir, tc.batch_size, shuffle=False)
  counts = np.bincount(train_ds.tokens[train_ds.loss_mask], minlength=target.config.vocab_size)
  drafter = drafter_trainer.init_drafter(method, target, config.drafter, counts)
  if method == "eagle3":
    assert drafter.config.draft_vocab_size == 512
  before = drafter_trainer.make_eval_fn(
    drafter_trainer.make_loss_fn(drafter, target, tc),
    drafter_trainer.frozen_inputs(drafter, target),
    val_ds,
    0,
    tc.seed,
  )(drafter.params["draft"])

  trained, result = drafter_trainer.train(
    drafter, target, tc, train_ds, val_ds, str(tmp_path / "a"), progress=False
  )
  assert result.step == tc.num_steps
  assert [h["step"] for h in result.history] == [6, 12]
  after = result.history[-1]
  assert after["loss"] < before["loss"] - 0.3, (before, after)
  # Greedy and sampled held-out continuations are also scored apart (equal halves here).
  parts = val_ds.by_temperature()
  assert sorted(parts) == [0.0, 1.0]
  for t, part in parts.items():
    assert np.all(part.temperature == t) and part.batches_per_epoch == val_ds.batches_per_epoch // 2
    rows = np.flatnonzero(val_ds.temperature == t)[: tc.batch_size]
    np.testing.assert_array_equal(part.batch_at(0)["tokens"], val_ds.tokens[rows])
  for key in ("loss",) + (("accept_len", "overlap") if method == "dflash" else ()):
    assert after[key] == pytest.approx((after[f"T=0/{key}"] + after[f"T=1/{key}"]) / 2)
  if method == "dflash":
    assert after["T=0/tau"] == pytest.approx(1 / after["T=0/passes_per_token"])
  # The shared target tensors are untouched; only the drafter's own weights moved.
  for k in trained.params:
    if k != "draft":
      assert trained.params[k] is drafter.params[k]

  with pytest.raises(_Interrupt):
    drafter_trainer.train(
      drafter, target, tc, _StopAt(train_ds, 7), val_ds, str(tmp_path / "b"), progress=False
    )
  resumed, res2 = drafter_trainer.train(
    drafter, target, tc, train_ds, val_ds, str(tmp_path / "b"), progress=False
  )
  assert res2.step == tc.num_steps and [h["step"] for h in res2.history] == [12]
  jax.tree_util.tree_map(
    np.testing.assert_array_equal, resumed.params["draft"], trained.params["draft"]
  )
  # Exported in the published layout, it loads back bit for bit.
  registry.save_drafter(trained, str(tmp_path / "export"))
  loaded = registry.load_drafter(str(tmp_path / "export"), target)
  jax.tree_util.tree_map(
    np.testing.assert_array_equal, loaded.params["draft"], trained.params["draft"]
  )


@pytest.mark.slow
def test_launch_script_trains_and_exports(tmp_path):
  target_dir = tiny_code.assets_dir("target")
  cmd = [
    sys.executable,
    "-m",
    "launch.train_drafter",
    "--config=configs/tiny_code.py:test_dflash",
    f"--target_dir={target_dir}",
    f"--workdir={tmp_path / 'run'}",
    f"--export_dir={tmp_path / 'dflash'}",
    "--progress=false",
    "--config.train.num_steps=4",
  ]
  env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.load(open(tmp_path / "run" / "summary_step4.json"))
  assert summary["method"] == "dflash" and len(summary["evals"]) == 1
  cfg = json.load(open(tmp_path / "dflash" / "config.json"))
  assert cfg["dflash_config"]["target_layer_ids"] == [0, 1]
  assert registry.checkpoint_kind(str(tmp_path / "dflash")) == "dflash"
