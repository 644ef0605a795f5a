"""DFlash with a draft vocabulary: the target's head rows of a subset of its ids.

Drafting scores only those rows (a propose reads V_d/V of the head), so the drafts lie in the
subset, q is zero off it, verification stays lossless, and the subset travels with the
checkpoint as EAGLE-3's d2t / t2d maps.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import jaxspec
from jaxspec.drafters.base import ProposeContext
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.errors import InputError
from jaxspec.models import target as target_lib
from jaxspec import sampling
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.train import drafter_losses as dl

from tests.drafter_models import (
  GreedyCheck,
  exact_sequence_probs,
  prompts,
  sampled_pvalue,
  small_dflash,
  small_target,
)

IDS = np.arange(3, 64, 2)  # every other id: half the vocabulary (with the mask id 2 outside)


@pytest.fixture(scope="module")
def target():
  return small_target(num_layers=3)


@pytest.fixture(scope="module")
def pair(target):
  """The same weights without and with the draft vocabulary."""
  full = small_dflash(target)
  sub = DFlashDrafter.for_target(target, full.config, full.params["draft"], draft_vocab=IDS)
  return full, sub


def test_drafts_come_from_the_subset_with_the_targets_rows(target, pair):
  full, sub = pair
  assert sub.config.draft_vocab_size == len(IDS) and sub.config.reduced_vocab
  engine = SpecEngine(target, full, EngineConfig(max_len=48, batch_size=2, use_eos=False))
  state = engine.init_state(prompts(2, 64), max_new_tokens=4)
  start = state.seq_len - 1
  root = state.tokens[jnp.arange(2), start]
  block = jnp.concatenate([root[:, None], jnp.full((2, 3), 2, jnp.int32)], axis=1)  # as propose
  want = np.asarray(full.block_logits(full.params, state.drafter_state, block, start))
  got = np.asarray(sub.block_logits(sub.params, state.drafter_state, block, start))
  np.testing.assert_allclose(got, want[..., IDS], rtol=1e-5, atol=1e-5)

  for temperature in (0.0, 1.0):
    params = sampling.make_sampling_params(2, temperature=temperature)
    ctx = ProposeContext(state.tokens, state.seq_len, params, jax.random.PRNGKey(0), None)
    proposal, _ = sub.propose(sub.params, state.drafter_state, ctx)
    drafts, q = np.asarray(proposal.tokens), np.asarray(proposal.probs)
    assert np.isin(drafts, IDS).all()
    off = np.setdiff1d(np.arange(64), IDS)
    assert np.all(q[..., off] == 0) and np.allclose(q.sum(-1), 1.0, atol=1e-5)
    assert np.all(np.asarray(proposal.logprobs)[..., off] <= -1e29)  # attention.NEG_INF
    if temperature == 0.0:  # the argmax over the subset, mapped to target ids
      np.testing.assert_array_equal(drafts, IDS[np.argmax(want[:, 1:, IDS], -1)])


def test_greedy_chain_and_tree_equal_plain(target, pair):
  check = GreedyCheck(target, pair[1])
  check.check(2)
  check.check(2, tree_budget=6)


def test_sampled_sequences_follow_the_target_distribution():
  target = small_target(vocab=6, num_layers=2, seed=3, factor=2.0)
  prompt, length = [1, 4, 2], 3
  outcomes, probs = exact_sequence_probs(target, prompt, length)
  drafter = DFlashDrafter.random(
    target,
    mask_token_id=2,
    num_layers=1,
    block_size=3,
    target_layer_ids=(0, 1),
    stddev=0.3,
    draft_vocab=[0, 3, 4, 5],
  )
  cfg = EngineConfig(max_len=16, batch_size=512, use_eos=False, min_prompt_bucket=4)
  engine = SpecEngine(target, drafter, cfg)
  assert sampled_pvalue(engine, prompt, length, 12, outcomes, probs) > 1e-4


def test_checkpoint_round_trip_keeps_the_subset(tmp_path, target, pair):
  _, sub = pair
  out = str(tmp_path / "d")
  jaxspec.save_drafter(sub, out)
  tensors = load_file(os.path.join(out, "model.safetensors"))
  np.testing.assert_array_equal(np.arange(len(IDS)) + tensors["d2t"], IDS)
  assert tensors["t2d"].sum() == len(IDS) and tensors["t2d"][IDS].all()
  with open(os.path.join(out, "config.json")) as f:
    assert json.load(f)["draft_vocab_size"] == len(IDS)
  loaded = jaxspec.load_drafter(out, target)
  np.testing.assert_array_equal(np.asarray(loaded.params["draft_vocab"]), IDS)
  np.testing.assert_array_equal(
    np.asarray(loaded.params["draft_head"]), np.asarray(sub.params["draft_head"])
  )
  other = jaxspec.load_drafter(out, target, draft_vocab=[5, 3, 7])  # replaces the stored one
  np.testing.assert_array_equal(np.asarray(other.params["draft_vocab"]), [3, 5, 7])
  os.remove(os.path.join(out, "model.safetensors"))  # the maps are required with the size
  save = {k: v for k, v in tensors.items() if k not in ("d2t", "t2d")}
  from safetensors.numpy import save_file  # pylint: disable=import-outside-toplevel

  save_file(save, os.path.join(out, "model.safetensors"))
  with pytest.raises(Exception, match="lacks d2t/t2d"):
    jaxspec.load_drafter(out, target)
  with pytest.raises(InputError, match="needs its ids"):
    DFlashDrafter.for_target(target, sub.config, sub.params["draft"])


def test_loss_over_the_subset(target, pair):
  """The whole vocabulary as a subset changes nothing; labels outside a subset add no loss and
  count as misses."""
  full, _ = pair
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(3, 64, (2, 20)).astype(np.int32))
  out = target_lib.forward(target.config, target.params, tokens, taps=full.taps)
  mask = jnp.asarray(np.r_[np.zeros(3, bool), np.ones(17, bool)][None].repeat(2, 0))
  anchors = dl.sample_anchors(jax.random.PRNGKey(7), mask, 5)
  common = dict(anchors=anchors, soft_weight=0.5, with_overlap=True, target_logits=out.logits)

  def loss(d, **kw):
    return dl.dflash_loss(d, d.params, tokens, out.taps, mask, None, **{**common, **kw})[1]

  everything = DFlashDrafter.for_target(
    target, full.config, full.params["draft"], draft_vocab=np.arange(64)
  )
  assert not everything.config.reduced_vocab and "draft_vocab" not in everything.params
  subset = np.union1d(np.unique(np.asarray(tokens)), [0, 1])[:-1]  # misses one label id
  sub = DFlashDrafter.for_target(target, full.config, full.params["draft"], draft_vocab=subset)
  base, cut = loss(full), loss(sub)
  assert float(cut["loss"]) != pytest.approx(float(base["loss"]))
  top = jax.lax.top_k(jax.nn.log_softmax(out.logits), 64)
  sparse = loss(sub, target_logits=None, target_top=(top[1], top[0]))
  for key in ("loss", "kl", "overlap", "accuracy"):  # the whole top-k over the subset
    assert float(sparse[key]) == pytest.approx(float(cut[key]), rel=2e-5, abs=1e-6), key
  none = DFlashDrafter.for_target(target, full.config, full.params["draft"], draft_vocab=[0, 1])
  hard = loss(none, soft_weight=0.0, target_logits=None)
  assert float(hard["loss"]) == 0.0 and float(hard["accuracy"]) == 0.0
