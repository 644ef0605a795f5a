"""Training objectives of the feature drafters (pure functions; the target is frozen).

Conventions: `tokens` [B, S] is a training sequence, `taps` [n_taps, B, S, H] the target's
features at every position (the drafter's `taps` layers, from one frozen target forward),
`loss_mask` [B, S] marks the tokens that are supervised targets (e.g. the assistant's reply).

- DFlash (SpecForge `OnlineDFlashModel`, the paper's Eq. 4): up to `num_anchors` random anchor
  positions per sequence, among positions whose token and next token are both supervised; each
  opens a block [x_anchor, MASK × (B−1)] at positions anchor..anchor+B−1 that sees the context
  strictly before its anchor and itself bidirectionally, and nothing of other blocks; slot k
  predicts x[anchor + k] (same position), slots 1..B−1 only, with weights exp(−(k−1)/γ), γ = 7.
  Optionally mixed with a soft cross-entropy against the target's own distribution at the
  same position (distillation of the whole distribution, for sampled drafting).
- EAGLE-3 (training-time test, SafeAILab `traineagle3`): the drafter is unrolled `steps` = 7
  times over every position, feeding back its own hidden states; step j at position i predicts
  t_{i+j+2} and is matched (soft cross-entropy) to the target's distribution at i+j+1,
  restricted to the draft vocabulary; step losses are weighted 0.8^j. As in the reference,
  positions whose target argmax lies outside the draft vocabulary are skipped.
- MTP (DeepSeek-V3): depth k reads the depth-(k−1) hidden (the target's final-normed hidden for
  k = 0) beside t_{i+k+1} and predicts t_{i+k+2}; cross-entropy per depth.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxspec.config import ModelConfig
from jaxspec.drafters.dflash import DFlashDrafter
from jaxspec.drafters.eagle3 import Eagle3Drafter
from jaxspec.drafters import features
from jaxspec.drafters.features import head_rows_expectation, head_rows_of
from jaxspec.models import target as target_lib


def _token_ce(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Per-position cross-entropy (nats) of float logits [..., V] against labels [...]."""
  logits = logits.astype(jnp.float32)
  picked = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - picked


# --------------------------------------------------------------------------------------------------
# DFlash
# --------------------------------------------------------------------------------------------------


def sample_anchors(
  key: jax.Array, loss_mask: jax.Array, num_anchors: int = 512
) -> tuple[jax.Array, jax.Array]:
  """Random block anchors: (anchors [B, N] int32 ascending, keep [B, N] bool).

  Candidates are positions a < S−1 with loss_mask[a] and loss_mask[a+1]; each sequence gets
  min(num_anchors, #candidates) distinct ones, drawn uniformly without replacement. N =
  min(num_anchors, S−1) is static; unused slots have keep False and anchor 0.
  """
  b, s = loss_mask.shape
  n = min(num_anchors, s - 1)
  m = loss_mask.astype(bool)
  valid = m[:, :-1] & m[:, 1:]
  u = jnp.where(valid, jax.random.uniform(key, valid.shape), 2.0)
  picked = jnp.argsort(u, axis=1)[:, :n].astype(jnp.int32)
  count = jnp.minimum(jnp.sum(valid, axis=1), n)
  keep = jnp.arange(n)[None] < count[:, None]
  anchors = jnp.sort(jnp.where(keep, picked, s), axis=1)
  keep = anchors < s
  return jnp.where(keep, anchors, 0).astype(jnp.int32), keep


def dflash_attention_mask(
  anchors: jax.Array, keep: jax.Array, seq_len: int, block_size: int, window: int = 0
) -> jax.Array:
  """The DFlash training mask as one dense bool array [B, N·bs, S + N·bs].

  Query row n·bs + t is slot t of block n; key columns are the S context features, then the
  N·bs block tokens. Visible: context column c iff c < anchor_n (and, with a sliding window W,
  anchor_n + t − c < W); block column m·bs + u iff m == n. Rows of unused blocks see nothing.
  `DFlashDrafter.train_hidden` applies exactly this rule block by block.
  """
  b, n = anchors.shape
  t = jnp.arange(block_size)
  q_pos = anchors[:, :, None] + t  # [B, N, bs]
  c = jnp.arange(seq_len)
  ctx = c[None, None, None, :] < anchors[:, :, None, None]  # [B, N, 1, S]
  ctx = jnp.broadcast_to(ctx, (b, n, block_size, seq_len))
  if window:
    ctx = ctx & (q_pos[..., None] - c < window)
  blk = jnp.eye(n, dtype=bool)[None, :, None, :, None]  # [1, N, 1, N, 1]
  blk = jnp.broadcast_to(blk, (b, n, block_size, n, block_size)).reshape(
    b, n, block_size, n * block_size
  )
  mask = jnp.concatenate([ctx, blk], axis=-1) & keep[:, :, None, None]
  return mask.reshape(b, n * block_size, seq_len + n * block_size)


def dflash_slot_weights(block_size: int, gamma: float = 7.0) -> jax.Array:
  """[bs] loss weight of each block slot: 0 for the anchor slot, exp(−(k−1)/γ) for k ≥ 1."""
  k = jnp.arange(block_size, dtype=jnp.float32)
  w = jnp.exp(-(k - 1.0) / gamma) if gamma else jnp.ones_like(k)
  return jnp.where(k >= 1, w, 0.0)


def dflash_loss(
  drafter: DFlashDrafter,
  params: Any,
  tokens: jax.Array,
  taps: jax.Array,
  loss_mask: jax.Array,
  key: jax.Array,
  *,
  num_anchors: int = 512,
  gamma: float = 7.0,
  block_size: Optional[int] = None,
  anchors: Optional[tuple[jax.Array, jax.Array]] = None,
  target_logits: Optional[jax.Array] = None,
  soft_weight: float = 0.0,
  with_overlap: bool = False,
  target_top: Optional[tuple[jax.Array, jax.Array]] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """DFlash's block objective on one batch: (weighted mean cross-entropy, metrics).

  `anchors` = (anchors, keep) overrides the random draw (for tests and evaluation).
  `target_logits` [B, S, V] (the frozen target's, position s predicting token s+1) give each
  slot a soft label too: slot k of anchor a is matched to the target's distribution (T = 1)
  after the true prefix x[..a+k−1], and the loss per slot is (1 − soft_weight)·CE(label) +
  soft_weight·CE(target distribution). Hard labels alone teach the argmax; the soft term
  teaches the whole distribution, which is what sampled drafting (T > 0) and tree building
  draw from.
  Metrics: "loss", "accuracy" (argmax = label over weighted slots), "accept_len" (mean length
  of each block's correct greedy prefix, slots 1..bs−1), "passes_per_token" (mean of
  1/(prefix + 1): its inverse estimates decoding's pooled τ, which accept_len + 1 overstates
  because random anchors land in long accepted runs by their length); with
  target_logits also "kl" (KL(target ‖ drafter) per slot) and, with `with_overlap` (a
  [B, N, bs, V] pass: evaluation), "overlap" (Σ min(p, q) per slot: the probability that a
  draft sampled from q survives verification against the target's p at T = 1 after a correct
  prefix).
  `target_top` = (ids, log-probs) [B, S, k] stands in for target_logits: the target's
  distribution truncated to its k most likely tokens and renormalised (`train.target_cache`).
  With a draft vocabulary (`DFlashConfig.draft_vocab_size`) the logits cover only its ids:
  labels outside it add no loss but count as misses in the metrics, and the target's
  distribution is renormalised over the ids inside it.
  """
  bs = block_size or drafter.config.block_size
  vocab = drafter.config.vocab_size
  b, s = tokens.shape
  if anchors is None:
    anchors = sample_anchors(key, loss_mask, num_anchors)
  anchor, keep = anchors
  hidden = drafter.train_hidden(params, tokens, taps, anchor, bs)  # [B, N, bs, H]
  logits = features.draft_logits(params, hidden, drafter.config.dtype)  # [B, N, bs, V_d]
  idx = anchor[..., None] + jnp.arange(bs)
  in_range = idx < s
  idx = jnp.minimum(idx, s - 1)
  labels = jnp.take_along_axis(tokens[:, None, :], idx, axis=2)
  draft_labels = features.target_to_draft_ids(params, labels, vocab)  # −1: no draft id
  supervised = jnp.take_along_axis(loss_mask.astype(bool)[:, None, :], idx, axis=2)
  valid = keep[..., None] & in_range & supervised & (jnp.arange(bs) >= 1)
  weights = valid * (draft_labels >= 0) * dflash_slot_weights(bs, gamma)
  logits = logits.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, jnp.maximum(draft_labels, 0)[..., None], axis=-1)[..., 0]
  ce = lse - picked
  metrics: dict[str, jax.Array] = {}
  if target_logits is not None or target_top is not None:
    if not 0.0 <= soft_weight <= 1.0:
      raise ValueError(f"soft_weight must be in [0, 1], got {soft_weight}")
    # Slot k predicts x[a+k]: the target's distribution for it is its output at a+k−1.
    prev = (jnp.arange(b)[:, None, None], jnp.maximum(idx - 1, 0))
    if target_top is not None:  # p over k stored ids per position
      top_ids, top_logp = target_top
      top_slots = features.target_to_draft_ids(params, top_ids, vocab)  # [B, S, k]
      # Renormalised over the ids with a draft id (finite: a row with none stays defined).
      top_logp = jnp.where(top_slots >= 0, top_logp.astype(jnp.float32), -1e30)
      logp = jax.nn.log_softmax(top_logp, axis=-1)  # [B, S, k]
      p = jnp.exp(logp)
      expected_row = jnp.einsum("bsk,bskh->bsh", p, head_rows_of(params, top_ids))
    else:
      target_logits = target_logits.astype(jnp.float32)
      if "draft_vocab" in params:
        target_logits = jnp.take(target_logits, params["draft_vocab"], axis=-1)
      logp = jax.nn.log_softmax(target_logits, axis=-1)  # [B, S, V_d]
      p = jnp.exp(logp)
      # The head is linear (logits = h·W), so Σ_v p_v·logits_v = h·(W p): the soft term needs
      # the target's expected head row per position [B, S, H], never a [B, N, bs, V] gather.
      expected_row = head_rows_expectation(params, p)
    soft_ce = lse - jnp.sum(hidden.astype(jnp.float32) * expected_row[prev], axis=-1)
    entropy = -jnp.sum(p * logp, axis=-1)  # [B, S]
    n_valid = jnp.maximum(jnp.sum(valid), 1)
    metrics["kl"] = jnp.sum((soft_ce - entropy[prev]) * valid) / n_valid
    if with_overlap:
      q = jax.nn.softmax(logits, axis=-1)
      if target_top is not None:  # p is zero off its k ids: Σ_v min(p, q) runs over those
        q = jnp.take_along_axis(q, jnp.maximum(top_slots[prev], 0), axis=-1)
      overlap = jnp.sum(jnp.minimum(p[prev], q), axis=-1)
      metrics["overlap"] = jnp.sum(overlap * valid) / n_valid
    ce = (1.0 - soft_weight) * ce + soft_weight * soft_ce
  elif soft_weight:
    raise ValueError("a soft-label weight needs the target's logits")
  loss = jnp.sum(weights * ce) / jnp.maximum(jnp.sum(weights), 1e-9)
  correct = features.draft_to_target_ids(params, jnp.argmax(logits, axis=-1)) == labels
  accuracy = jnp.sum(correct * valid) / jnp.maximum(jnp.sum(valid), 1)
  prefix = jnp.cumprod(jnp.where(valid[..., 1:], correct[..., 1:], True), axis=-1) * valid[..., 1:]
  accepted = jnp.sum(prefix, -1)  # [B, N]
  n_blocks = jnp.maximum(jnp.sum(keep), 1)
  accept_len = jnp.sum(accepted * keep) / n_blocks
  # Anchors sample positions uniformly, so long accepted runs (loops) weigh in by their length,
  # while decoding spends one pass on each: target passes per token, 1/(accepted + 1) averaged
  # over positions, is what decoding's pooled τ inverts (τ ≈ 1 / passes_per_token).
  passes_per_token = jnp.sum(keep / (accepted + 1.0)) / n_blocks
  return loss, dict(
    metrics,
    loss=loss,
    accuracy=accuracy,
    accept_len=accept_len,
    passes_per_token=passes_per_token,
  )


# --------------------------------------------------------------------------------------------------
# EAGLE-3
# --------------------------------------------------------------------------------------------------


def eagle3_ttt_loss(
  drafter: Eagle3Drafter,
  params: Any,
  tokens: jax.Array,
  taps: jax.Array,
  target_logits: Optional[jax.Array],
  loss_mask: jax.Array,
  *,
  steps: int = 7,
  decay: float = 0.8,
  target_top: Optional[tuple[jax.Array, jax.Array]] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """EAGLE-3's training-time-test objective: Σ_j decay^j · soft-CE_j.

  target_logits [B, S, V]: the frozen target's logits (position s predicts token s+1).
  Step j at position i is supervised iff i+j+2 < S and loss_mask[i+j+2]; its target is
  softmax of target_logits[i+j+1] over the draft vocabulary. Each step's loss is averaged over
  its supervised positions; those whose target argmax has no draft id contribute zero.
  `target_top` = (ids, log-probs) [B, S, k] (sorted, most likely first) stands in for
  target_logits: the target's top k, renormalised over those with a draft id.
  """
  c = drafter.config
  b, s = tokens.shape
  logits = drafter.ttt_logits(params, tokens, taps, steps)  # steps × [B, S, V_d]
  draft_ids = jnp.arange(c.draft_vocab_size) + params["d2t"] if c.reduced_vocab else None
  # The target's side once for all steps: argmax, membership, draft-vocabulary distribution.
  if target_top is not None:
    p_target, top = _draft_distribution_of_top(c, draft_ids, *target_top)
  else:
    tl = target_logits.astype(jnp.float32)
    top = jnp.argmax(tl, axis=-1)  # [B, S]
    if draft_ids is not None:
      tl = jnp.take(tl, draft_ids, axis=-1)
    p_target = jax.nn.softmax(tl, axis=-1)  # [B, S, V_d]
  if draft_ids is not None:
    in_draft = jnp.zeros((c.vocab_size,), bool).at[draft_ids].set(True)[top]
  else:
    in_draft = jnp.ones_like(top, bool)
  mask = loss_mask.astype(bool)
  total = jnp.float32(0.0)
  metrics: dict[str, jax.Array] = {}
  for j in range(steps):
    # Step j at position i (< S − j − 2) is scored against the target at i + j + 1, when the
    # token at i + j + 2 is supervised.
    shift, n = j + 1, s - j - 2
    if n < 1:
      raise ValueError(f"sequences of {s} tokens are too short for {steps} TTT steps")
    sup = mask[:, shift + 1 :]
    top_j = top[:, shift : shift + n]
    use = sup & in_draft[:, shift : shift + n]
    logq = jax.nn.log_softmax(logits[j][:, :n].astype(jnp.float32), axis=-1)
    ce = -jnp.sum(p_target[:, shift : shift + n] * logq, axis=-1)
    denom = jnp.maximum(jnp.sum(sup), 1)
    loss_j = jnp.sum(jnp.where(use, ce, 0.0)) / denom
    pred = jnp.argmax(logq, axis=-1)
    if draft_ids is not None:
      pred = jnp.take(draft_ids, pred)
    metrics[f"loss_{j}"] = loss_j
    metrics[f"accuracy_{j}"] = jnp.sum((pred == top_j) & sup) / denom
    total = total + decay**j * loss_j
  metrics["loss"] = total
  return total, metrics


def _draft_distribution_of_top(
  c: Any, draft_ids: Optional[jax.Array], top_ids: jax.Array, top_logp: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """(p over the draft vocabulary [B, S, V_d], the target's argmax [B, S]) from its top k."""
  if draft_ids is None:
    slot, has = top_ids, jnp.ones(top_ids.shape, bool)
  else:  # target id → draft id (−1: none)
    t2d = jnp.full((c.vocab_size,), -1, jnp.int32).at[draft_ids].set(
      jnp.arange(c.draft_vocab_size, dtype=jnp.int32)
    )
    slot = t2d[top_ids]
    has = slot >= 0
  weight = jnp.where(has, jnp.exp(top_logp.astype(jnp.float32)), 0.0)
  weight = weight / jnp.maximum(jnp.sum(weight, axis=-1, keepdims=True), 1e-30)
  b, s, k = top_ids.shape
  p = jnp.zeros((b, s, c.draft_vocab_size), jnp.float32)
  p = p.at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], jnp.maximum(slot, 0)].add(
    weight
  )
  return p, top_ids[..., 0]


# --------------------------------------------------------------------------------------------------
# MTP
# --------------------------------------------------------------------------------------------------


def mtp_loss(
  config: ModelConfig,
  params: Any,
  tokens: jax.Array,
  hidden: jax.Array,
  loss_mask: Optional[jax.Array] = None,
  *,
  num_depths: Optional[int] = None,
  reuse_layer: Optional[int] = None,
  weights: Optional[tuple[float, ...]] = None,
) -> tuple[jax.Array, dict[str, Any]]:
  """Cross-entropy of the target's MTP layers at depths 0..num_depths−1 (target frozen).

  hidden [B, S, H]: the target's final-normed hidden states of `tokens` [B, S]. Depth k reads
  the depth-(k−1) output h_i (the target hidden for k = 0) beside t_{i+k+1} at RoPE position i
  and predicts t_{i+k+2}; it uses MTP layer k (DeepSeek-V3's sequential modules), or layer
  `reuse_layer` at every depth (the chained reuse of one layer that the MTP drafter runs).
  Returns (Σ_k weights[k] · CE_k, {"mtp_loss_k": CE_k, "loss"}); weights default to 1/depths.
  """
  depths = num_depths or config.num_mtp_layers
  if depths < 1:
    raise ValueError("mtp_loss needs at least one depth")
  if reuse_layer is None and depths > config.num_mtp_layers:
    raise ValueError(
      f"{depths} depths but the model has {config.num_mtp_layers} MTP layers; "
      f"pass reuse_layer to chain one layer"
    )
  weights = weights or (1.0 / depths,) * depths
  b, s = tokens.shape
  start = jnp.zeros((b,), jnp.int32)
  total = jnp.float32(0.0)
  metrics: dict[str, Any] = {}
  h = hidden
  for k in range(depths):
    n = s - 2 - k
    if n < 1:
      raise ValueError(f"sequences of {s} tokens are too short for MTP depth {k}")
    layer = k if reuse_layer is None else reuse_layer
    logits, h, _ = target_lib.apply_mtp(
      config, params, layer, tokens[:, k + 1 : k + 1 + n], h[:, :n], start
    )
    ce = _token_ce(logits, tokens[:, k + 2 : k + 2 + n])
    if loss_mask is None:
      ce_k = jnp.mean(ce)
    else:
      m = loss_mask[:, k + 2 : k + 2 + n].astype(jnp.float32)
      ce_k = jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)
    metrics[f"mtp_loss_{k}"] = ce_k
    total = total + weights[k] * ce_k
  metrics["loss"] = total
  return total, metrics
