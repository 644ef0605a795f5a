"""Speculative-decoding statistics, accumulated on device and summarised on the host.

`SpecStats` lives inside the engine state and is updated in the jitted step (no
host round trip); `summarize` turns it into the numbers that papers report:
acceptance length (tokens committed per target pass, bonus included, 1.0 for
plain decoding), per-position acceptance rates, throughput and time to first token.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class SpecStats:
  """Per-sequence counters (a pytree of int32 arrays).

  Attributes:
    target_passes: [B] verify passes of the target in which the sequence was active.
    tokens_committed: [B] tokens committed by those passes (accepted drafts + 1).
    accept_hist: [B, γ+1] how many passes accepted exactly k drafts, k = 0..γ.
    tree_ranks: [B, γ, K, NB, 2] under tree verification (else [B, 1] zeros): at depth d + 1,
      how often the walk tried the child of sibling rank r whose sorted draft probability fell in
      bucket b (`tree_verify.q_buckets`), and how often it accepted it
      (`tree_verify.rank_outcomes`); what `launch/bench.py tree-calibrate` measures. Passes of
      all-greedy batches, which skip the draft distribution, count in the last bucket.
  """

  target_passes: jax.Array
  tokens_committed: jax.Array
  accept_hist: jax.Array
  tree_ranks: jax.Array

  @property
  def gamma(self) -> int:
    return self.accept_hist.shape[-1] - 1


def init_stats(batch: int, gamma: int, tree_ranks: tuple[int, ...] = ()) -> SpecStats:
  """Zeroed statistics for ``batch`` sequences and chains of ``gamma`` drafts (and, with
  ``tree_ranks`` = (K, NB), trees of up to K siblings)."""
  return SpecStats(
    target_passes=jnp.zeros((batch,), jnp.int32),
    tokens_committed=jnp.zeros((batch,), jnp.int32),
    accept_hist=jnp.zeros((batch, gamma + 1), jnp.int32),
    # Without a tree a [B, 1] placeholder: a None leaf would still get a sharding on a mesh,
    # and a zero-size one is laid out unlike its sharding.
    tree_ranks=jnp.zeros((batch, gamma, *tree_ranks, 2) if tree_ranks else (batch, 1), jnp.int32),
  )


def update_stats(
  stats: SpecStats,
  num_accepted: jax.Array,
  active: jax.Array,
  num_committed: Optional[jax.Array] = None,
  ranks: Optional[jax.Array] = None,
) -> SpecStats:
  """Records one verify pass (jit-able).

  Args:
    stats: current statistics.
    num_accepted: [B] int drafts accepted this pass, in [0, γ].
    active: [B] bool; finished / padded sequences are not counted.
    num_committed: optional [B] tokens actually committed when fewer than
      ``num_accepted + 1`` are kept (a stop token or max length cut the chain);
      defaults to ``num_accepted + 1``.
    ranks: optional [B, γ, K, NB, 2] this pass's tree walk outcomes (`Accepted.ranks`).

  Returns:
    Updated statistics.
  """
  num_accepted = num_accepted.astype(jnp.int32)
  act = active.astype(jnp.int32)
  if num_committed is None:
    num_committed = num_accepted + 1
  one_hot = jax.nn.one_hot(num_accepted, stats.gamma + 1, dtype=jnp.int32)
  return SpecStats(
    target_passes=stats.target_passes + act,
    tokens_committed=stats.tokens_committed + act * num_committed.astype(jnp.int32),
    accept_hist=stats.accept_hist + act[:, None] * one_hot,
    tree_ranks=stats.tree_ranks
    if ranks is None
    else stats.tree_ranks + act.reshape((-1,) + (1,) * (ranks.ndim - 1)) * ranks.astype(jnp.int32),
  )


def summarize(stats: SpecStats, elapsed_s: float, ttft_s: Optional[float] = None) -> Dict[str, Any]:
  """Host-side summary over the whole batch.

  Args:
    stats: accumulated statistics (fetched to host here).
    elapsed_s: wall time the caller measured for the decode loop; tokens/s is
      ``tokens_committed / elapsed_s``.
    ttft_s: time to first token (prefill + first sample), reported as given.

  Returns:
    A dict with ``acceptance_length`` (tokens committed per target pass, bonus
    included), ``acceptance_length_per_seq`` (list), ``acceptance_rate_per_position``
    (for draft position i, the fraction of passes that reached position i in which
    it was accepted: P(n > i | n >= i)), ``accepted_at_least`` (P(n > i)),
    ``accept_hist`` (counts of n = 0..γ over the batch), ``target_passes``,
    ``tokens_committed``, ``tokens_per_second``, ``elapsed_s``, ``ttft_s``; under tree
    verification also ``tree_rank_tried`` and ``tree_rank_accepted`` ([γ][K][NB] counts
    summed over the batch).
  """
  passes = np.asarray(jax.device_get(stats.target_passes), np.int64)
  committed = np.asarray(jax.device_get(stats.tokens_committed), np.int64)
  hist = np.asarray(jax.device_get(stats.accept_hist), np.int64)
  total_passes = int(passes.sum())
  total_committed = int(committed.sum())
  hist_total = hist.sum(axis=0)  # [γ+1]
  gamma = hist_total.shape[0] - 1
  # reached[i] = passes with n >= i; passed[i] = passes with n > i.
  at_least = np.cumsum(hist_total[::-1])[::-1]  # at_least[i] = #(n >= i)
  reached = at_least[:gamma]
  passed = at_least[1:]
  with np.errstate(divide="ignore", invalid="ignore"):
    rate = np.where(reached > 0, passed / np.maximum(reached, 1), np.nan)
    per_seq = np.where(passes > 0, committed / np.maximum(passes, 1), np.nan)
  denom = max(total_passes, 1)
  ranks = {}
  if stats.tree_ranks.ndim > 2:
    counts = np.asarray(jax.device_get(stats.tree_ranks), np.int64).sum(axis=0)
    ranks = {
      "tree_rank_tried": counts[..., 0].tolist(),
      "tree_rank_accepted": counts[..., 1].tolist(),
    }
  return {
    **ranks,
    "acceptance_length": total_committed / total_passes if total_passes else float("nan"),
    "acceptance_length_per_seq": per_seq.tolist(),
    "acceptance_rate_per_position": rate.tolist(),
    "accepted_at_least": (passed / denom).tolist(),
    "accept_hist": hist_total.tolist(),
    "target_passes": total_passes,
    "tokens_committed": total_committed,
    "tokens_per_second": total_committed / elapsed_s if elapsed_s > 0 else float("nan"),
    "elapsed_s": float(elapsed_s),
    "ttft_s": None if ttft_s is None else float(ttft_s),
  }
