"""Prompt-lookup (n-gram) drafting as a pure device function.

The drafter looks for the most recent earlier occurrence of the sequence's last
m tokens (m from ``n`` down to ``min_n``) and proposes the γ tokens that followed
that occurrence. Everything is static-shape and vectorised over the batch (each
sequence with its own length), so it runs inside the jitted engine step with no
host work. The proposal is deterministic, so verification uses a one-hot q.
"""

from __future__ import annotations

from typing import Tuple

import jax
import jax.numpy as jnp


def ngram_propose(
  tokens: jax.Array, lengths: jax.Array, n: int, gamma: int, min_n: int = 1
) -> Tuple[jax.Array, jax.Array]:
  """Proposes γ draft tokens per sequence by n-gram lookup in its own history.

  For m = n, n-1, ..., min_n (the first m that matches wins): find the largest
  end position e <= length-2 with tokens[e-m+1 : e+1] == tokens[length-m : length],
  i.e. the most recent occurrence of the suffix other than the suffix itself
  (occurrences may overlap it). The proposal copies the tokens after it:
  ``draft[j] = tokens[e + 1 + j]``. When that runs past the end of the sequence,
  the copy continues from its own output (an LZ77-style overlapping copy): with
  period P = length - 1 - e, ``draft[j] = tokens[e + 1 + (j mod P)]``. This is
  the continuation that the match predicts if the text keeps repeating, e.g.
  history ``a b c a b`` with n=2 proposes ``c a b c ...``.

  Sequences without a match (or with length < min_n + 1) get ``found = False``
  and a draft of their last token repeated (token 0 of the buffer if empty), so
  the output is always a valid token array.

  Args:
    tokens: [B, L] int token buffer; only positions < lengths[b] are read.
    lengths: [B] int valid lengths, 0 <= lengths <= L.
    n: largest n-gram size (static).
    gamma: number of draft tokens (static).
    min_n: smallest n-gram size tried (static), 1 <= min_n <= n.

  Returns:
    draft: [B, γ] int32 proposed tokens.
    found: [B] bool, whether some n-gram matched.
  """
  if not 1 <= min_n <= n:
    raise ValueError(f"need 1 <= min_n <= n, got min_n={min_n}, n={n}")
  if gamma < 1:
    raise ValueError(f"gamma must be >= 1, got {gamma}")
  tokens = tokens.astype(jnp.int32)
  lengths = lengths.astype(jnp.int32)
  batch, max_len = tokens.shape
  pos = jnp.arange(max_len, dtype=jnp.int32)[None, :]  # candidate end positions e
  rows = jnp.arange(batch)

  best_end = jnp.full((batch,), -1, jnp.int32)
  match = jnp.ones((batch, max_len), bool)  # suffix of size m ends at e
  for m in range(1, n + 1):  # static loop over n-gram sizes, not over tokens
    k = m - 1
    # tokens[e - k] for every e (a right shift by k; -1 never equals a token id).
    shifted = jnp.pad(tokens, ((0, 0), (k, 0)), constant_values=-1)[:, :max_len]
    suffix_tok = tokens[rows, jnp.clip(lengths - 1 - k, 0, max_len - 1)]
    match = match & (shifted == suffix_tok[:, None]) & (pos >= k)
    if m >= min_n:
      valid = match & (pos <= lengths[:, None] - 2) & (lengths[:, None] >= m + 1)
      end_m = jnp.max(jnp.where(valid, pos, -1), axis=1)
      best_end = jnp.where(end_m >= 0, end_m, best_end)  # larger m overrides

  found = best_end >= 0
  period = jnp.maximum(lengths - 1 - best_end, 1)
  j = jnp.arange(gamma, dtype=jnp.int32)[None, :]
  idx = best_end[:, None] + 1 + j % period[:, None]
  draft = jnp.take_along_axis(tokens, jnp.clip(idx, 0, max_len - 1), axis=1)
  last = tokens[rows, jnp.clip(lengths - 1, 0, max_len - 1)]
  draft = jnp.where(found[:, None], draft, last[:, None])
  return draft.astype(jnp.int32), found
