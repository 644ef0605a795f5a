"""Logit warping and sampling with per-sequence parameters.

Sampling parameters are arrays (one entry per sequence), never static arguments,
so that a jitted step compiled once serves every temperature / top-k / top-p.

Warping order (as in Hugging Face ``generate``): temperature, then top-k, then
top-p, all computed in float32. A row with ``temperature <= 0`` is *greedy*: its
warped distribution is defined as the one-hot at ``argmax`` of the raw logits
(lowest index on ties, like ``jnp.argmax``). Verification at temperature 0 then
goes through exactly the same code path as sampled verification.

Randomness: every random draw of the engine (sampling, drafting, verification) takes either
one PRNG key for the whole batch (uint32 [2]) or *row keys* (uint32 [B, 2], see `row_keys`).
With row keys, row b's draws come from key b alone, so a sequence's random stream does not
depend on which batch row it sits in or on its neighbours: a request served in any slot of a
continuously batched engine samples exactly what it samples alone. `split_key`, `fold_in`
and `uniform` accept both forms.
"""

from __future__ import annotations

from typing import Sequence, Union

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.errors import InputError

ArrayLike = Union[jax.Array, np.ndarray, float, int, Sequence[float], Sequence[int]]

NEG_INF = float("-inf")


@flax.struct.dataclass
class SamplingParams:
  """Per-sequence sampling parameters (a pytree of arrays).

  Attributes:
    temperature: [B] float32; ``<= 0`` means greedy (argmax).
    top_k: [B] int32; keep the k most likely tokens, ``0`` (or ``>= V``) = off.
    top_p: [B] float32; nucleus mass in (0, 1]; ``1.0`` = off.
  """

  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array

  @property
  def batch_size(self) -> int:
    return self.temperature.shape[0]


def _broadcast_param(name: str, value: ArrayLike, batch: int, dtype) -> np.ndarray:
  arr = np.asarray(value)
  if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] not in (1, batch)):
    raise InputError(
      f"sampling parameter {name!r} must be a scalar or have length batch={batch}, "
      f"got shape {arr.shape}"
    )
  return np.broadcast_to(arr, (batch,)).astype(dtype)


def make_sampling_params(
  batch: int, temperature: ArrayLike = 0.0, top_k: ArrayLike = 0, top_p: ArrayLike = 1.0
) -> SamplingParams:
  """Builds `SamplingParams` for ``batch`` sequences, broadcasting scalars / lists.

  Host-side helper: values are validated here so that a bad request fails with a
  clear message instead of silently producing a wrong distribution.

  Args:
    batch: number of sequences B.
    temperature: scalar or [B]; must be >= 0 (0 = greedy).
    top_k: scalar or [B]; must be >= 0 (0 = off).
    top_p: scalar or [B]; must be in (0, 1] (1 = off).

  Returns:
    SamplingParams with float32 / int32 arrays of shape [B].
  """
  if batch <= 0:
    raise InputError(f"batch must be positive, got {batch}")
  t = _broadcast_param("temperature", temperature, batch, np.float32)
  k = _broadcast_param("top_k", top_k, batch, np.int32)
  p = _broadcast_param("top_p", top_p, batch, np.float32)
  if not np.all(np.isfinite(t)) or np.any(t < 0):
    raise InputError(f"temperature must be finite and >= 0, got {t.tolist()}")
  if np.any(k < 0):
    raise InputError(f"top_k must be >= 0 (0 = off), got {k.tolist()}")
  if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
    raise InputError(f"top_p must be in (0, 1] (1 = off), got {p.tolist()}")
  return SamplingParams(temperature=jnp.asarray(t), top_k=jnp.asarray(k), top_p=jnp.asarray(p))


def _per_row(x: jax.Array, ndim: int) -> jax.Array:
  """Reshapes a [B] parameter to [B, 1, ..., 1] to broadcast against ndim-rank logits."""
  return x.reshape(x.shape[:1] + (1,) * (ndim - 1))


def argmax(x: jax.Array) -> jax.Array:
  """int32 index of the first maximum along the last axis (`jnp.argmax` for NaN-free input).

  Two plain reductions (max, then the smallest index equal to it) instead of XLA's variadic
  (value, index) reduce, which XLA:CPU does not vectorise: measured 3× faster over a [16, 8192]
  block of logits, a large share of a speculative step on CPU. Works for bool arrays too
  (first True; 0 for an all-False row). A NaN-containing row gives the last index.
  """
  n = x.shape[-1]
  top = jnp.max(x, axis=-1, keepdims=True)
  iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
  return jnp.minimum(jnp.min(jnp.where(x == top, iota, n), axis=-1), n - 1).astype(jnp.int32)


def is_greedy(params: SamplingParams) -> jax.Array:
  """[B] bool: rows that decode greedily (temperature <= 0)."""
  return params.temperature <= 0


def greedy_logits(logits: jax.Array) -> jax.Array:
  """Warped logits of a greedy row: 0 at the argmax (lowest index on ties), -inf elsewhere."""
  logits = logits.astype(jnp.float32)
  top = argmax(logits)
  iota = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  return jnp.where(iota == top[..., None], 0.0, NEG_INF).astype(jnp.float32)


def warp_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Applies temperature, top-k and top-p per sequence; masked entries are -inf.

  Args:
    logits: [B, ..., V] raw logits (any float dtype; computed in float32).
    params: per-sequence parameters with arrays of shape [B]; they broadcast over
      the middle axes (e.g. the γ+1 verify positions).

  Returns:
    [B, ..., V] float32 warped logits. Greedy rows are the one-hot at argmax (see
    `greedy_logits`). Top-k keeps every token whose logit is >= the k-th largest
    (ties at the boundary are kept, as in Hugging Face). Top-p keeps the smallest
    prefix of the sorted distribution whose mass reaches p, always including the
    most likely token; ties with the last kept logit are kept too.
  """
  logits = logits.astype(jnp.float32)
  nd = logits.ndim
  vocab = logits.shape[-1]
  temp = _per_row(params.temperature.astype(jnp.float32), nd)
  top_k = _per_row(params.top_k.astype(jnp.int32), nd)
  top_p = _per_row(params.top_p.astype(jnp.float32), nd)
  greedy = temp <= 0

  scaled = logits / jnp.where(greedy, 1.0, temp)
  k_on = (top_k > 0) & (top_k < vocab)
  p_on = top_p < 1.0

  def truncate(x: jax.Array) -> jax.Array:
    # One descending sort serves both top-k and top-p.
    sorted_desc = -jnp.sort(-x, axis=-1)
    # Top-k: threshold at the k-th largest value.
    k_idx = jnp.clip(top_k, 1, vocab) - 1
    kth = jnp.where(k_on, jnp.take_along_axis(sorted_desc, k_idx, axis=-1), NEG_INF)
    sorted_k = jnp.where(sorted_desc >= kth, sorted_desc, NEG_INF)
    # Top-p on the top-k-filtered distribution: keep sorted position i while the
    # mass strictly before i is < p. The exclusive cumsum is a shift of the
    # (monotone) inclusive cumsum, so the kept set is always a prefix.
    cum = jnp.cumsum(jax.nn.softmax(sorted_k, axis=-1), axis=-1)
    cum_excl = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    keep = ((cum_excl < top_p) | ~p_on).at[..., 0].set(True)
    n_keep = jnp.sum(keep, axis=-1, keepdims=True)
    pth = jnp.take_along_axis(sorted_k, n_keep - 1, axis=-1)
    threshold = jnp.maximum(kth, jnp.where(p_on, pth, NEG_INF))
    return jnp.where(x >= threshold, x, NEG_INF)

  # Skip the vocabulary sort when no row uses top-k or top-p (the common case).
  warped = jax.lax.cond(jnp.any((k_on | p_on) & ~greedy), truncate, lambda x: x, scaled)
  return jnp.where(greedy, greedy_logits(logits), warped)


def warped_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
  """[B, ..., V] float32 probabilities of the warped distribution (exact one-hot for greedy rows)."""
  return jax.nn.softmax(warp_logits(logits, params), axis=-1)


def row_keys(seeds: Sequence[int], rows: Sequence[int] = ()) -> jax.Array:
  """uint32 [B, 2] row keys: row b's key is fold_in(PRNGKey(seeds[b]), rows[b]) (rows default
  to 0). A request's key depends only on its seed and index, never on its batch row."""
  index = list(rows) or [0] * len(seeds)
  if len(index) != len(seeds):
    raise ValueError(f"{len(seeds)} seeds but {len(index)} row indices")
  return jnp.stack(
    [jax.random.fold_in(jax.random.PRNGKey(s), i) for s, i in zip(seeds, index)]
  ).astype(jnp.uint32)


def _row_keyed(key: jax.Array) -> bool:
  return key.ndim == 2


def split_key(key: jax.Array, num: int = 2) -> jax.Array:
  """[num, *key.shape]: `num` new keys (per row for row keys), as jax.random.split."""
  if not _row_keyed(key):
    return jax.random.split(key, num)
  return jnp.swapaxes(jax.vmap(lambda k: jax.random.split(k, num))(key), 0, 1)


def fold_in(key: jax.Array, data: jax.Array | int) -> jax.Array:
  """jax.random.fold_in, per row for row keys."""
  if not _row_keyed(key):
    return jax.random.fold_in(key, data)
  return jax.vmap(lambda k: jax.random.fold_in(k, data))(key)


def uniform(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """float32 U[0, 1) of `shape` = [B, ...]; with row keys [B, 2] row b draws from key b."""
  if not _row_keyed(key):
    return jax.random.uniform(key, shape, dtype=jnp.float32)
  if not shape or shape[0] != key.shape[0]:
    raise ValueError(f"row keys for {key.shape[0]} rows cannot draw an array of shape {shape}")
  return jax.vmap(lambda k: jax.random.uniform(k, shape[1:], dtype=jnp.float32))(key)


def sample(key: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
  """Samples one token per position from the warped distribution.

  When every row is greedy (the common benchmark case) a `lax.cond` skips warping and
  drawing entirely.

  Args:
    key: a PRNG key (one for the whole batch; rows get independent draws) or row keys
      [B, 2] (see the module docstring).
    logits: [B, ..., V] raw logits.
    params: per-sequence sampling parameters ([B] arrays).

  Returns:
    [B, ...] int32 tokens; greedy rows are exactly ``argmax(logits)``.
  """
  logits = logits.astype(jnp.float32)
  top = argmax(logits)
  greedy = is_greedy(params)

  def draw(_):
    return sample_from_probs(key, jax.nn.softmax(warp_logits(logits, params), axis=-1))

  drawn = jax.lax.cond(jnp.all(greedy), lambda _: top, draw, None)
  return jnp.where(_per_row(greedy, logits.ndim - 1), top, drawn).astype(jnp.int32)


def sample_from_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
  """Samples indices from (possibly unnormalised) non-negative weights along the last axis.

  Inverse-CDF sampling with one uniform per row: the first index whose running sum exceeds
  u · total. Callers may pass a residual ``max(0, p - q)`` directly; zero-weight entries are
  never drawn (the running sum does not grow there). One random number per row instead of
  one per vocabulary entry (Gumbel-max) is what makes sampling cheap at an 8K+ vocabulary.
  """
  probs = probs.astype(jnp.float32)
  cdf = jnp.cumsum(probs, axis=-1)
  u = uniform(key, probs.shape[:-1]) * cdf[..., -1]
  idx = argmax(cdf > u[..., None])
  # If u·total rounds up to total (or all weights are 0) fall back to the last positive entry.
  last_positive = probs.shape[-1] - 1 - argmax((probs > 0)[..., ::-1])
  found = jnp.any(cdf > u[..., None], axis=-1)
  return jnp.where(found, idx, last_positive).astype(jnp.int32)


def leading_true_count(mask: jax.Array) -> jax.Array:
  """[B] int32: length of the all-True prefix of each row of a [B, γ] bool mask."""
  padded = jnp.concatenate([mask.astype(bool), jnp.zeros(mask.shape[:1] + (1,), bool)], axis=1)
  return jnp.argmin(padded, axis=1).astype(jnp.int32)  # index of the first False
