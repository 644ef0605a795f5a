"""Drafter training objectives: DFlash anchors, mask and weights; EAGLE-3 TTT; MTP depths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.base import PrefillContext
from jaxspec.drafters.features import target_head
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.models import target as target_lib
from jaxspec.train import drafter_losses as dl
from jaxspec.train import losses as target_losses

from tests.drafter_models import dflash_reference_logits, small_dflash, small_target

MASK = 2


def _loss_mask(rng, b, s):
  m = rng.random((b, s)) < 0.8
  m[:, :3] = False  # an unsupervised "prompt"
  return m


# ------------------------------------------------------------------------------------------------
# DFlash
# ------------------------------------------------------------------------------------------------


def test_anchor_sampling():
  rng = np.random.default_rng(0)
  mask = _loss_mask(rng, 3, 40)
  mask[2] = False
  mask[2, 10:12] = True  # exactly one candidate
  seen = set()
  for seed in range(20):
    anchors, keep = map(np.asarray, dl.sample_anchors(jax.random.PRNGKey(seed), mask, 8))
    assert anchors.shape == (3, 8)
    for b in range(3):
      cand = [a for a in range(39) if mask[b, a] and mask[b, a + 1]]
      got = anchors[b][keep[b]]
      assert len(got) == min(8, len(cand)) and len(set(got)) == len(got)
      assert set(got) <= set(cand) and np.all(np.diff(got) > 0)
      assert np.all(anchors[b][~keep[b]] == 0) and np.all(keep[b][: len(got)])
      if b == 0:
        seen |= set(got.tolist())
  cand0 = {a for a in range(39) if mask[0, a] and mask[0, a + 1]}
  assert seen == cand0  # every candidate gets drawn eventually
  anchors, keep = dl.sample_anchors(jax.random.PRNGKey(0), mask, 512)
  assert anchors.shape == (3, 39)


def _brute_force_mask(anchors, keep, s, bs, window):
  b, n = anchors.shape
  out = np.zeros((b, n * bs, s + n * bs), bool)
  for bi in range(b):
    for blk in range(n):
      if not keep[bi, blk]:
        continue
      a = anchors[bi, blk]
      for t in range(bs):
        q = blk * bs + t
        for c in range(s):
          out[bi, q, c] = c < a and (not window or (a + t) - c < window)
        for m in range(n * bs):
          out[bi, q, s + m] = m // bs == blk
  return out


@pytest.mark.parametrize("window", [0, 5])
def test_training_mask_equals_the_rule(window):
  rng = np.random.default_rng(1)
  s, bs = 24, 4
  mask = _loss_mask(rng, 2, s)
  anchors, keep = dl.sample_anchors(jax.random.PRNGKey(3), mask, 6)
  got = np.asarray(dl.dflash_attention_mask(anchors, keep, s, bs, window))
  want = _brute_force_mask(np.asarray(anchors), np.asarray(keep), s, bs, window)
  np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def dflash_setup():
  target = small_target(num_layers=3)
  drafter = small_dflash(target)
  rng = np.random.default_rng(2)
  s = 20
  tokens = rng.integers(3, 64, (2, s)).astype(np.int32)
  out = target_lib.forward(target.config, target.params, jnp.asarray(tokens), taps=drafter.taps)
  mask = _loss_mask(rng, 2, s)
  anchors = dl.sample_anchors(jax.random.PRNGKey(7), mask, 5)
  return target, drafter, tokens, out.taps, mask, anchors


def _supervised_slots(anchors, keep, mask, bs):
  """(row, block, slot, position) of every supervised slot k ≥ 1 of every kept block."""
  s = mask.shape[1]
  for b in range(anchors.shape[0]):
    for n in range(anchors.shape[1]):
      for k in range(1, bs):
        pos = anchors[b, n] + k
        if keep[b, n] and pos < s and mask[b, pos]:
          yield b, n, k, pos


def _dense_reference(drafter, target, tokens, taps, anchors, keep, mask):
  """Training logits by plain masked attention over [S context; all N·bs block tokens]."""
  bs = drafter.config.block_size
  b, n = tokens.shape[0], anchors.shape[1]
  out = []
  for bi in range(b):
    block = np.full((n, bs), MASK)
    block[:, 0] = tokens[bi, anchors[bi]]
    qpos = (anchors[bi][:, None] + np.arange(bs)).reshape(-1)
    out.append(
      dflash_reference_logits(drafter, target, taps[:, bi], block.reshape(-1), qpos, mask[bi])
    )
  return np.stack(out).reshape(b, n, bs, -1)


def test_training_forward_applies_the_mask_and_matches_inference(dflash_setup):
  target, drafter, tokens, taps, _, (anchors, keep) = dflash_setup
  s, bs = tokens.shape[1], drafter.config.block_size
  hidden = drafter.train_hidden(drafter.params, jnp.asarray(tokens), taps, anchors)
  got = np.asarray(target_head(drafter.params, hidden, "float32"))
  mask = np.asarray(dl.dflash_attention_mask(anchors, keep, s, bs))
  want = _dense_reference(
    drafter,
    target,
    tokens,
    np.asarray(taps, np.float64),
    np.asarray(anchors),
    np.asarray(keep),
    mask,
  )
  k = np.asarray(keep)
  np.testing.assert_allclose(got[k], want[k], atol=2e-4, rtol=2e-4)
  # One block against the inference path: context = the target features before its anchor.
  a = int(anchors[0, 1])
  st = drafter.init_state(drafter.params, 1, s)
  st = drafter.prefill(
    drafter.params,
    st,
    PrefillContext(jnp.asarray(tokens[:1]), jnp.array([a]), taps[:, :1, :a], taps[0, :1, :a]),
  )
  block = jnp.asarray([[tokens[0, a]] + [MASK] * (bs - 1)])
  inf = np.asarray(drafter.block_logits(drafter.params, st, block, jnp.array([a])))
  np.testing.assert_allclose(inf[0], got[0, 1], atol=2e-4, rtol=2e-4)


def test_dflash_loss_weights_slots_and_masks(dflash_setup):
  target, drafter, tokens, taps, mask, (anchors, keep) = dflash_setup
  del target
  s, bs = tokens.shape[1], drafter.config.block_size

  def objective(params):
    return dl.dflash_loss(
      drafter, params, jnp.asarray(tokens), taps, jnp.asarray(mask), None, anchors=(anchors, keep)
    )

  (loss, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(drafter.params)
  logits = np.asarray(
    target_head(
      drafter.params,
      drafter.train_hidden(drafter.params, jnp.asarray(tokens), taps, anchors),
      "float32",
    ),
    np.float64,
  )
  num = den = 0.0
  a_np, k_np = np.asarray(anchors), np.asarray(keep)
  for b, n, k, pos in _supervised_slots(a_np, k_np, mask, bs):
    lg = logits[b, n, k]
    ce = np.log(np.sum(np.exp(lg - lg.max()))) + lg.max() - lg[tokens[b, pos]]
    w = np.exp(-(k - 1) / 7.0)
    num, den = num + w * ce, den + w
  assert float(loss) == pytest.approx(num / den, rel=1e-5)
  assert 0.0 <= float(metrics["accuracy"]) <= 1.0
  # Accepted prefix of each kept block (unsupervised slots neither count nor break it), and
  # target passes per token, its position-weighted inverse.
  accepted = []
  for b in range(tokens.shape[0]):
    for n in range(a_np.shape[1]):
      if not k_np[b, n]:
        continue
      run = 0
      for k in range(1, bs):
        pos = a_np[b, n] + k
        if pos >= s or not mask[b, pos]:
          continue
        if np.argmax(logits[b, n, k]) != tokens[b, pos]:
          break
        run += 1
      accepted.append(run)
  assert float(metrics["accept_len"]) == pytest.approx(np.mean(accepted), rel=1e-6)
  want = np.mean(1.0 / (np.asarray(accepted) + 1.0))
  assert float(metrics["passes_per_token"]) == pytest.approx(want, rel=1e-6)
  np.testing.assert_allclose(
    np.asarray(dl.dflash_slot_weights(4)), [0.0, 1.0, np.exp(-1 / 7), np.exp(-2 / 7)], rtol=1e-6
  )
  # Gradients reach the drafter's own weights.
  assert float(jnp.abs(grads["draft"]["fc"]["kernel"]).sum()) > 0


def test_dflash_soft_labels_are_the_target_distribution_one_position_back(dflash_setup):
  target, drafter, tokens, taps, mask, (anchors, keep) = dflash_setup
  bs = drafter.config.block_size
  tl = target_lib.forward(target.config, target.params, jnp.asarray(tokens)).logits
  w_soft = 0.25

  def objective(params):
    return dl.dflash_loss(
      drafter,
      params,
      jnp.asarray(tokens),
      taps,
      jnp.asarray(mask),
      None,
      anchors=(anchors, keep),
      target_logits=tl,
      soft_weight=w_soft,
      with_overlap=True,
    )

  (loss, metrics), grads = jax.jit(jax.value_and_grad(objective, has_aux=True))(drafter.params)
  hidden = drafter.train_hidden(drafter.params, jnp.asarray(tokens), taps, anchors)
  logits = np.asarray(target_head(drafter.params, hidden, "float32"), np.float64)
  tl = np.asarray(tl, np.float64)

  def log_softmax(x):
    x = x - x.max()
    return x - np.log(np.sum(np.exp(x)))

  num = den = kl = overlap = count = 0.0
  a_np, k_np = np.asarray(anchors), np.asarray(keep)
  for b, n, k, pos in _supervised_slots(a_np, k_np, mask, bs):
    logq, logp = log_softmax(logits[b, n, k]), log_softmax(tl[b, pos - 1])
    p = np.exp(logp)
    soft = -np.sum(p * logq)
    ce = (1 - w_soft) * -logq[tokens[b, pos]] + w_soft * soft
    w = np.exp(-(k - 1) / 7.0)
    num, den = num + w * ce, den + w
    kl += np.sum(p * (logp - logq))
    overlap += np.sum(np.minimum(p, np.exp(logq)))
    count += 1
  assert float(loss) == pytest.approx(num / den, rel=1e-5)
  assert float(metrics["kl"]) == pytest.approx(kl / count, rel=1e-4)
  assert float(metrics["overlap"]) == pytest.approx(overlap / count, rel=1e-4)
  assert float(jnp.abs(grads["draft"]["fc"]["kernel"]).sum()) > 0
  assert 0.0 < float(metrics["overlap"]) <= 1.0 and float(metrics["kl"]) >= 0.0
  with pytest.raises(ValueError, match="soft_weight"):
    dl.dflash_loss(
      drafter,
      drafter.params,
      jnp.asarray(tokens),
      taps,
      jnp.asarray(mask),
      None,
      anchors=(anchors, keep),
      target_logits=jnp.asarray(tl),
      soft_weight=1.5,
    )


# ------------------------------------------------------------------------------------------------
# EAGLE-3
# ------------------------------------------------------------------------------------------------


def test_eagle3_ttt_loss_matches_a_manual_unroll():
  target = small_target(num_layers=4)
  rng = np.random.default_rng(4)
  vocab = rng.choice(64, 40, replace=False)
  drafter = Eagle3Drafter.random(target, draft_vocab=vocab, target_layer_ids=(0, 2, 3), stddev=0.2)
  b, s, steps = 2, 12, 3
  tokens = rng.integers(3, 64, (b, s)).astype(np.int32)
  out = target_lib.forward(target.config, target.params, jnp.asarray(tokens), taps=drafter.taps)
  mask = _loss_mask(rng, b, s)
  loss, metrics = dl.eagle3_ttt_loss(
    drafter,
    drafter.params,
    jnp.asarray(tokens),
    out.taps,
    out.logits,
    jnp.asarray(mask),
    steps=steps,
  )
  ttt = np.asarray(
    drafter.ttt_logits(drafter.params, jnp.asarray(tokens), out.taps, steps), np.float64
  )
  tl = np.asarray(out.logits, np.float64)
  ids = np.arange(40) + np.asarray(drafter.params["d2t"])
  total = 0.0
  for j in range(steps):
    num, den = 0.0, 0
    for bi in range(b):
      for i in range(s):
        if i + j + 2 >= s or not mask[bi, i + j + 2]:
          continue
        den += 1
        t = tl[bi, i + j + 1]
        if t.argmax() not in set(ids.tolist()):
          continue
        p = np.exp(t[ids] - t[ids].max())
        p /= p.sum()
        lq = ttt[j, bi, i] - ttt[j, bi, i].max()
        lq -= np.log(np.exp(lq).sum())
        num -= np.sum(p * lq)
    assert float(metrics[f"loss_{j}"]) == pytest.approx(num / max(den, 1), rel=1e-4)
    total += 0.8**j * num / max(den, 1)
  assert float(loss) == pytest.approx(total, rel=1e-4)


def _top(logits, k):
  """The (ids, log-probs) a target cache stores: the top k of log_softmax(logits)."""
  logp, ids = jax.lax.top_k(jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1), k)
  return ids, logp


def test_losses_from_the_top_k_equal_the_full_distribution_when_k_is_the_vocabulary(dflash_setup):
  """A cache's (ids, log-probs) with k = V is the whole distribution: every loss and metric of
  the sparse path equals the dense one; truncated to k = 2 the soft terms must move."""
  target, drafter, tokens, taps, mask, anchors = dflash_setup
  tl = target_lib.forward(target.config, target.params, jnp.asarray(tokens)).logits
  v = tl.shape[-1]
  common = dict(anchors=anchors, soft_weight=0.5, with_overlap=True)
  args = (drafter, drafter.params, jnp.asarray(tokens), taps, jnp.asarray(mask), None)
  _, dense = dl.dflash_loss(*args, target_logits=tl, **common)
  _, full = dl.dflash_loss(*args, target_top=_top(tl, v), **common)
  _, cut = dl.dflash_loss(*args, target_top=_top(tl, 2), **common)
  for key in ("loss", "kl", "overlap", "accuracy"):
    assert float(full[key]) == pytest.approx(float(dense[key]), rel=2e-5, abs=1e-6), key
  assert abs(float(cut["kl"]) - float(dense["kl"])) > 1e-3

  e_target = small_target(num_layers=4)
  rng = np.random.default_rng(5)
  eagle = Eagle3Drafter.random(
    e_target, draft_vocab=rng.choice(64, 40, replace=False), target_layer_ids=(0, 2, 3), stddev=0.2
  )
  e_tokens = jnp.asarray(rng.integers(3, 64, (2, 12)).astype(np.int32))
  out = target_lib.forward(e_target.config, e_target.params, e_tokens, taps=eagle.taps)
  e_mask = jnp.asarray(_loss_mask(rng, 2, 12))
  e_args = (eagle, eagle.params, e_tokens, out.taps)
  d_loss, d_m = dl.eagle3_ttt_loss(*e_args, out.logits, e_mask, steps=3)
  s_loss, s_m = dl.eagle3_ttt_loss(
    *e_args, None, e_mask, steps=3, target_top=_top(out.logits, out.logits.shape[-1])
  )
  assert float(s_loss) == pytest.approx(float(d_loss), rel=2e-5)
  for j in range(3):
    assert float(s_m[f"accuracy_{j}"]) == float(d_m[f"accuracy_{j}"])
  c_loss, _ = dl.eagle3_ttt_loss(*e_args, None, e_mask, steps=3, target_top=_top(out.logits, 2))
  assert abs(float(c_loss) - float(d_loss)) > 1e-3


# ------------------------------------------------------------------------------------------------
# MTP
# ------------------------------------------------------------------------------------------------


def test_mtp_loss_per_depth():
  target = small_target(num_mtp_layers=2)
  cfg, params = target.config, target.params
  rng = np.random.default_rng(5)
  batch = jnp.asarray(rng.integers(0, 64, (2, 14)).astype(np.int32))
  _, ref = target_losses.lm_losses(cfg, params, batch, mtp_weight=1.0)
  hidden = target_lib.forward(cfg, params, batch).hidden
  loss, metrics = dl.mtp_loss(cfg, params, batch, hidden)
  for k in range(2):
    assert float(metrics[f"mtp_loss_{k}"]) == pytest.approx(float(ref[f"mtp_loss_{k}"]), rel=1e-5)
  assert float(loss) == pytest.approx(
    0.5 * sum(float(ref[f"mtp_loss_{k}"]) for k in range(2)), rel=1e-5
  )
  # Chained reuse of layer 0 at depth 1 (what the MTP drafter runs), with a loss mask.
  mask = np.ones((2, 14), bool)
  mask[:, :6] = False
  _, chained = dl.mtp_loss(
    cfg, params, batch, hidden, jnp.asarray(mask), num_depths=2, reuse_layer=0
  )
  _, h1, _ = target_lib.apply_mtp(cfg, params, 0, batch[:, 1:13], hidden[:, :12])
  lg, _, _ = target_lib.apply_mtp(cfg, params, 0, batch[:, 2:13], h1[:, :11])
  lg = np.asarray(lg, np.float64)
  labels = np.asarray(batch[:, 3:14])
  ce = (
    np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1))
    + lg.max(-1)
    - np.take_along_axis(lg, labels[..., None], -1)[..., 0]
  )
  m = mask[:, 3:14]
  assert float(chained["mtp_loss_1"]) == pytest.approx(float((ce * m).sum() / m.sum()), rel=1e-5)
