"""Chunked prefill: a long prompt prefilled C positions at a time equals one-shot prefill.

The target's cache and first-token logits, every drafter's state after its chunk-by-chunk
prefill, and the generations that follow are compared between a small chunk (several chunks,
ragged prompt ends inside different chunks) and one chunk holding the whole prompt.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.drafters import registry
from jaxspec.speculative import step as step_lib
from tests import near_ties

DRAFT_DIRS = {"dflash": "dflash", "eagle3": "eagle3", "draft_model": "draft", "mtp": None}
CHUNK = 16


@functools.lru_cache(maxsize=None)
def _target():
  return jaxspec.load_model(registry.bundled_dir("target"), scan_layers=False)


@functools.lru_cache(maxsize=None)
def _drafter(method):
  target = _target()
  draft_dir = DRAFT_DIRS[method] and registry.bundled_dir(DRAFT_DIRS[method])
  return registry.make_drafter(method, target, draft_dir=draft_dir)


def _prompts(lengths=(45, 23, 33)):
  tok = _target().tokenizer
  text = "\n".join(
    ["import os", "def read(path):", "  with open(path) as f:", "    return f.read()"] * 20
  )
  ids = tok.encode(text)
  return [ids[i : i + n] for i, n in enumerate(lengths)]


def _engine(method, prefill_chunk, **kw):
  drafter = None if method == "plain" else _drafter(method)
  cfg = jaxspec.EngineConfig(
    max_len=128, batch_size=3, use_eos=False, prefill_chunk=prefill_chunk, **kw
  )
  return jaxspec.SpecEngine(_target(), drafter, cfg)


def _live(x, lens, axis):
  """x's slots below each row's length along `axis` (batch first), as float64 numpy."""
  x = np.asarray(x, np.float64)
  return [np.take(x[b], np.arange(n), axis=axis - 1) for b, n in enumerate(lens)]


def _assert_live_close(a, b, lens, axis):
  for x, y in zip(_live(a, lens, axis), _live(b, lens, axis)):
    np.testing.assert_allclose(x, y, atol=2e-5, rtol=2e-5)


def test_target_chunks_equal_one_shot_prefill():
  """Cache slots below each prompt's length and the last-position logits, for every chunk."""
  target = _target()
  ids = _prompts()
  lens = np.array([len(p) for p in ids], np.int32)
  tokens = np.zeros((3, 64), np.int32)
  for i, p in enumerate(ids):
    tokens[i, : len(p)] = p
  one_logits, one_state, _, _ = step_lib.prefill_prompts(
    target.config,
    target.params,
    jnp.asarray(tokens[:, :45]),
    jnp.asarray(lens),
    target.init_state(3, 64),
  )
  run = jax.jit(step_lib.prefill_chunk, static_argnums=(0, 4))
  state = target.init_state(3, 64)
  logits = np.zeros(one_logits.shape, np.float32)
  seen = np.zeros(3, bool)
  for c in range(3):  # 3 chunks of 16: the prompt ends fall in chunks 1, 2 and 2
    out, inside, state, _, _ = run(
      target.config,
      target.params,
      jnp.asarray(tokens),
      jnp.int32(c * CHUNK),
      CHUNK,
      jnp.asarray(lens),
      state,
    )
    inside = np.asarray(inside)
    assert not (inside & seen).any()
    logits[inside] = np.asarray(out)[inside]
    seen |= inside
  assert seen.all()
  np.testing.assert_allclose(logits, np.asarray(one_logits), atol=2e-5, rtol=2e-5)
  for a, b in zip(state.segments, one_state.segments):
    for x, y in ((a.k, b.k), (a.v, b.v)):
      for layer in range(x.shape[0]):
        _assert_live_close(x[layer], y[layer], lens, axis=1)


@pytest.mark.parametrize(
  "method",
  [
    "plain",
    "dflash",
    "eagle3",
    # Same chunk seam as eagle3's (a drafter KV cache fed chunk by chunk): with the slow ones.
    pytest.param("mtp", marks=pytest.mark.slow),
    pytest.param("draft_model", marks=pytest.mark.slow),
  ],
)
def test_engine_state_and_generation_equal_one_shot(method):
  """The SpecState after prefill (tokens, first token, target cache, drafter state), then the
  greedy generation and its number of target passes, equal those of one-shot prefill."""
  ids = _prompts()
  lens = [len(p) for p in ids]
  one, chunked = _engine(method, 2048), _engine(method, CHUNK)
  s1, s2 = one.init_state(ids, 8), chunked.init_state(ids, 8)
  np.testing.assert_array_equal(np.asarray(s1.tokens), np.asarray(s2.tokens))
  for a, b in zip(s1.target_state.segments, s2.target_state.segments):
    for layer in range(a.k.shape[0]):
      _assert_live_close(a.k[layer], b.k[layer], lens, axis=1)
      _assert_live_close(a.v[layer], b.v[layer], lens, axis=1)
  _assert_drafter_states_equal(method, s1.drafter_state, s2.drafter_state, lens)

  g1 = one.generate(ids, max_new_tokens=24)
  g2 = chunked.generate(ids, max_new_tokens=24)
  near_ties.assert_greedy_match(_target(), ids, g1.tokens, g2.tokens)
  if g1.tokens == g2.tokens:
    assert g1.stats.target_passes == g2.stats.target_passes


def _assert_drafter_states_equal(method, a, b, lens):
  if method == "plain":
    return
  if method == "dflash":
    np.testing.assert_array_equal(np.asarray(a.ctx_pos), np.asarray(b.ctx_pos))
    valid = np.asarray(a.ctx_pos) >= 0
    for x, y in ((a.ctx_k, b.ctx_k), (a.ctx_v, b.ctx_v)):
      np.testing.assert_allclose(
        np.asarray(x)[:, valid], np.asarray(y)[:, valid], atol=2e-5, rtol=2e-5
      )
    return
  if method == "eagle3":
    # Entry i reads (f_i, t_{i+1}): entries below each prompt's length are the prompt's.
    for x, y in ((a.kv.k[0], b.kv.k[0]), (a.kv.v[0], b.kv.v[0])):
      _assert_live_close(x, y, lens, axis=1)
    np.testing.assert_allclose(
      np.asarray(a.last_feature), np.asarray(b.last_feature), atol=2e-5, rtol=2e-5
    )
    return
  if method == "mtp":
    for x, y in zip(a.cache.segments, b.cache.segments):
      _assert_live_close(x.k[0], y.k[0], lens, axis=1)
      _assert_live_close(x.v[0], y.v[0], lens, axis=1)
    np.testing.assert_array_equal(np.asarray(a.cache.lengths), np.asarray(b.cache.lengths))
    np.testing.assert_allclose(
      np.asarray(a.last_hidden), np.asarray(b.last_hidden), atol=2e-5, rtol=2e-5
    )
    return
  for x, y in zip(a.cache.segments, b.cache.segments):
    for layer in range(x.k.shape[0]):
      _assert_live_close(x.k[layer], y.k[layer], lens, axis=1)
  np.testing.assert_array_equal(np.asarray(a.cache.lengths), np.asarray(b.cache.lengths))


def test_sampled_first_token_is_the_one_shot_one():
  """At T=1 the first token of each prompt is drawn with the same key as in one-shot prefill,
  whichever chunk holds the prompt's end."""
  ids = _prompts()
  firsts = []
  for chunk in (2048, CHUNK):
    s = _engine("plain", chunk).init_state(ids, 8, temperature=1.0, seed=3)
    firsts.append(np.asarray(s.tokens)[np.arange(3), [len(p) for p in ids]])
  np.testing.assert_array_equal(*firsts)


def test_one_compilation_for_every_long_prompt_length():
  engine = _engine("dflash", CHUNK)
  for n in (40, 45, 52, 61):
    engine.init_state([_prompts((n,))[0]], 4)
  assert engine.compile_counts()["prefill"] == 1


def test_features_reach_the_drafter_chunk_by_chunk(monkeypatch):
  """The drafter's prefill sees chunk-sized features, never the whole prompt's."""
  drafter = _drafter("dflash")
  sizes = []
  original = type(drafter).prefill

  def spy(self, params, state, ctx):
    sizes.append(ctx.taps.shape[2])
    return original(self, params, state, ctx)

  monkeypatch.setattr(type(drafter), "prefill", spy)
  _engine("dflash", CHUNK).init_state(_prompts(), 4)
  assert sizes == [CHUNK]  # traced once, inside the on-device chunk loop


def test_prefill_chunk_is_validated():
  with pytest.raises(jaxspec.ConfigError, match="prefill_chunk"):
    jaxspec.EngineConfig(prefill_chunk=0)
