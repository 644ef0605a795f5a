"""Tests for jaxspec.drafters.ngram_lookup against a slow pure-Python reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters.ngram_lookup import ngram_propose


def _reference(seq, n, gamma, min_n=1):
  """Pure-Python prompt lookup: most recent earlier match, largest n first, LZ77-style copy."""
  length = len(seq)
  for m in range(n, min_n - 1, -1):
    if length < m + 1:
      continue
    suffix = seq[length - m :]
    for start in range(length - m - 1, -1, -1):
      if seq[start : start + m] == suffix:
        ext = list(seq)
        for j in range(gamma):
          ext.append(ext[start + m + j])  # may read tokens it just proposed
        return ext[length:], True
  return None, False


def _run(seqs, n, gamma, min_n=1, max_len=None):
  max_len = max_len or max(len(s) for s in seqs)
  buf = np.full((len(seqs), max_len), 99, np.int32)  # garbage beyond each length
  for b, s in enumerate(seqs):
    buf[b, : len(s)] = s
  lengths = np.array([len(s) for s in seqs], np.int32)
  fn = jax.jit(ngram_propose, static_argnames=("n", "gamma", "min_n"))
  draft, found = fn(jnp.asarray(buf), jnp.asarray(lengths), n=n, gamma=gamma, min_n=min_n)
  return np.asarray(draft), np.asarray(found), buf


def test_hand_examples():
  seqs = [
    [1, 2, 3, 1, 2],  # bigram "1 2" at 0 -> 3, then copy continues: 3 1 2 3
    [5, 6, 7, 8, 6],  # only the unigram "6" matches -> 7 8 6 7
    [4, 4, 4, 4],  # overlapping run -> 4 4 4 4
    [1, 2, 3, 4],  # no repeat
    [9, 1, 2, 8, 1, 2, 7, 1, 2],  # most recent earlier "1 2" (the one followed by 7)
  ]
  draft, found, _ = _run(seqs, n=2, gamma=4)
  np.testing.assert_array_equal(found, [True, True, True, False, True])
  np.testing.assert_array_equal(draft[0], [3, 1, 2, 3])
  np.testing.assert_array_equal(draft[1], [7, 8, 6, 7])
  np.testing.assert_array_equal(draft[2], [4, 4, 4, 4])
  np.testing.assert_array_equal(draft[3], [4, 4, 4, 4])  # not found: last token repeated
  np.testing.assert_array_equal(draft[4], [7, 1, 2, 7])


def test_longer_ngram_has_priority():
  # "3" last occurred at index 4 (followed by 5); the bigram "2 3" occurred at 1..2 (followed by 0).
  seq = [1, 2, 3, 0, 3, 5, 2, 3]
  draft, found, _ = _run([seq], n=2, gamma=2)
  assert found[0]
  np.testing.assert_array_equal(draft[0], [0, 3])
  draft, _, _ = _run([seq], n=1, gamma=2)
  np.testing.assert_array_equal(draft[0], [5, 2])


def test_min_n_excludes_short_matches():
  draft, found, _ = _run([[5, 6, 7, 8, 6]], n=3, gamma=2, min_n=2)
  assert not found[0]


def test_short_and_empty_sequences():
  draft, found, _ = _run([[], [3], [3, 3]], n=3, gamma=3, max_len=6)
  np.testing.assert_array_equal(found, [False, False, True])
  np.testing.assert_array_equal(draft[1], [3, 3, 3])
  np.testing.assert_array_equal(draft[2], [3, 3, 3])
  assert draft.dtype == np.int32 and draft.shape == (3, 3)


@pytest.mark.parametrize(
  "n, gamma, min_n, vocab", [(1, 3, 1, 3), (3, 5, 1, 4), (4, 4, 2, 3), (2, 7, 2, 6)]
)
def test_matches_reference_on_random_sequences(n, gamma, min_n, vocab):
  rng = np.random.RandomState(n * 100 + gamma * 10 + vocab)
  batch, max_len = 64, 24
  seqs = [list(rng.randint(0, vocab, rng.randint(0, max_len + 1))) for _ in range(batch)]
  draft, found, buf = _run(seqs, n=n, gamma=gamma, min_n=min_n, max_len=max_len)
  for b, s in enumerate(seqs):
    want, want_found = _reference([int(t) for t in s], n, gamma, min_n)
    assert found[b] == want_found, (s, found[b])
    if want_found:
      np.testing.assert_array_equal(draft[b], want, err_msg=str(s))
    else:
      np.testing.assert_array_equal(draft[b], [buf[b, max(len(s) - 1, 0)]] * gamma)


def test_bad_static_arguments():
  with pytest.raises(ValueError, match="min_n"):
    ngram_propose(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), n=2, gamma=2, min_n=3)
  with pytest.raises(ValueError, match="gamma"):
    ngram_propose(jnp.zeros((1, 4), jnp.int32), jnp.array([4]), n=2, gamma=0)
