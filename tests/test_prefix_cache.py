"""Prompt prefixes cached in pages: requests behind a shared system prompt prefill only the rest.

The first request's full prompt pages stay in the pool after it ends; later prompts that start
with the same 200 tokens hold those pages and prefill only their own suffix. Their outputs must
equal a contiguous engine's (the drafter's state after a hit is what a full prefill gives: its
features are kept in pages too), /metrics must count the tokens read from the cache, and the
allocator must evict cached pages least recently released first, a prompt's later pages before
its earlier ones.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.errors import ConfigError, InputError
from jaxspec.io import hf
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.serve.pages import PageAllocator
from jaxspec.speculative import prefix as prefix_lib
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig
from jaxspec.speculative.request import SamplingArgs

from tests import near_ties

MAX_LEN, PAGE, SYSTEM = 256, 16, 200


@pytest.fixture(scope="module")
def drafter(target, bundled_drafter):
  return bundled_drafter("eagle3")


def _text(target) -> list[int]:
  with open("docs/serving.md") as f:
    return target.tokenizer.encode(f.read())


@pytest.fixture(scope="module")
def engine(target, drafter):
  """One paged EAGLE-3 engine with the prefix cache for the tests below (compiled once)."""
  config = EngineConfig(
    max_len=MAX_LEN,
    batch_size=4,
    stream_every=2,
    page_size=PAGE,
    kv_pages=40,
    prefix_cache=True,
    warm_choices=2,  # the server's n = 2 group compiled with the rest
  )
  return SpecEngine(target, drafter, config)


@pytest.fixture(scope="module")
def reference(target, drafter):
  """A contiguous engine: what the cached engine must generate."""
  return SpecEngine(target, drafter, EngineConfig(max_len=MAX_LEN, batch_size=8))


def test_cached_prefill_equals_a_full_prefill(target, drafter, engine, reference):
  """prefill_cached after cached pages: the same first token and drafter state as a full
  prefill of the prompt (the drafter absorbed the kept features), and only the new pages are
  copied into the pool."""
  assert engine._prefix_width == len(drafter.taps) * target.config.hidden_size
  ids = _text(target)
  first, second = ids[:80], ids[:64] + ids[300:310]
  pool = engine.config.num_pages
  table = np.full((4, MAX_LEN // PAGE), pool, np.int32)
  table[0, :8] = np.arange(8)
  table[1, :4], table[1, 4:8] = table[0, :4], np.arange(8, 12)  # 4 shared pages: 64 tokens
  state = engine.set_page_table(engine.empty_state(), table)
  greedy = SamplingArgs(max_new_tokens=12, temperature=0.0)
  state = engine.insert(state, 0, engine.prefill_cached(state, first, greedy))
  before = np.asarray(state.prefix_features[:4])
  cached = engine.prefill_cached(state, second, greedy, pages=table[1, :4].tolist())
  full = engine.prefill_row(second, greedy)
  np.testing.assert_array_equal(cached.tokens, full.tokens)
  # EAGLE-3's draft cache k, v [1, 1, max_len, K, D] and its last feature; slots past the
  # prompt are scratch (each prefill pads to its own bucket), the rest must agree.
  cache, full_cache = cached.drafter_state.kv, full.drafter_state.kv
  for got, want in ((cache.k, full_cache.k), (cache.v, full_cache.v)):
    np.testing.assert_allclose(got[:, :, : len(second)], want[:, :, : len(second)], atol=2e-5)
  np.testing.assert_allclose(
    cached.drafter_state.last_feature, full.drafter_state.last_feature, atol=2e-5
  )
  state = engine.insert(state, 1, cached)
  np.testing.assert_array_equal(state.prefix_features[:4], before)  # shared pages untouched
  state = engine.run(state)
  want = reference.generate([first, second], greedy).tokens
  got = [list(map(int, t)) for t in engine._outputs(state, 2)]
  if got != want:
    near_ties.assert_greedy_match(target, [first, second], want, got)
  with pytest.raises(InputError, match="last position"):
    engine.prefill_cached(state, first[:64], greedy, pages=[0, 1, 2, 3])


def test_shared_system_prompt_hits_the_cache(target, engine, reference):
  """Eight requests behind one 200-token system prompt (greedy, sampled, and n = 2): every
  request after the first reads its 12 full pages from the cache, /metrics counts them, the
  outputs equal a contiguous engine's, and nothing compiles while serving."""
  scheduler = Scheduler(engine, max_queue=16)
  scheduler.start()
  ids = _text(target)
  system = ids[:SYSTEM]
  rng = np.random.default_rng(0)
  prompts = []
  for _ in range(7):
    at = int(rng.integers(SYSTEM, len(ids) - 32))
    prompts.append(system + ids[at : at + int(rng.integers(4, 20))])
  requests = [
    (p, SamplingOptions(max_tokens=16, temperature=0.8 if i % 3 == 2 else 0.0, seed=50 + i))
    for i, p in enumerate(prompts)
  ]
  try:
    compiled = engine.compile_counts()
    scheduler.submit(*requests[0]).result()  # the first prefills all of its prompt
    assert scheduler.metrics()["prefix_cache_hit_tokens_total"] == 0
    group = scheduler.submit_n(prompts[1], requests[1][1], 2)  # one prefill, cached pages
    handles = scheduler.submit_many(requests[1:])
    results = [h.result() for h in handles]
    choices = [h.result()[0] for h in group]
    grown = engine.compile_counts()
    metrics = scheduler.metrics()
  finally:
    scheduler.shutdown(drain=False, timeout=60)
  full_pages = SYSTEM // PAGE * PAGE  # 192 tokens of every later prompt are cached
  assert metrics["prefix_cache_hit_tokens_total"] == 7 * full_pages
  total = sum(len(p) for p in prompts) + len(prompts[1])
  assert metrics["prompt_tokens_prefilled_total"] == total - 7 * full_pages
  assert metrics["prefix_cache_pages"] >= SYSTEM // PAGE and metrics["kv_pages_used"] == 0
  assert grown == compiled  # the n = 2 group's cached prefill included (warm_choices)
  assert choices[0] == results[0][0]  # choice 0 keeps the request's seed

  want = reference.generate(
    [p for p, _ in requests[1:]],
    max_new_tokens=[o.max_tokens for _, o in requests[1:]],
    temperature=[o.temperature for _, o in requests[1:]],
    seed=[o.seed for _, o in requests[1:]],
  ).tokens
  for (ids_, options), (tokens, _, _), expected in zip(requests[1:], results, want):
    if expected and expected[-1] in reference.stop_ids:
      expected = expected[:-1]
    if tokens != expected and options.temperature == 0:
      near_ties.assert_greedy_match(target, [ids_], [expected], [tokens])
    elif options.temperature:
      assert len(tokens) <= options.max_tokens
  sampled = [
    r[0] == w[: len(r[0])] for (_, o), r, w in zip(requests[1:], results, want) if o.temperature
  ]
  assert sum(sampled) >= len(sampled) - 1  # a draw at a float-noise CDF boundary may flip


def test_allocator_caches_and_evicts_least_recent_first():
  pages = PageAllocator(num_pages=6, page_size=2, rows=2, pages_per_row=3, prefix_cache=True)
  a = [1, 2, 3, 4, 5]  # two full pages; the last token is always left to compute
  assert pages.lookup(a) == []
  assert pages.grow(0, 6) and pages.pages(0) == [0, 1, 2]
  assert pages.register(0, a) == 2 and pages.cached == 2
  assert pages.lookup(a) == [0, 1] and pages.lookup(a[:4]) == [0]  # [1,2,3] leaves one page
  assert pages.lookup([1, 2, 9, 9, 9]) == [0] and pages.lookup([7, 2, 3, 4, 5]) == []
  pages.release(0)
  assert pages.free == 6 and pages.used == 0 and pages.cached == 2  # cached, but evictable
  pages.attach(1, pages.lookup(a))
  assert pages.free == 4 and pages.grow(1, 6) and pages.pages(1) == [0, 1, 2]
  pages.release(1)
  # A row wanting every page evicts the cached ones: page 1 (the later one) before page 0.
  assert pages.grow(0, 6) and pages.pages(0) == [2, 3, 4] and pages.evictions == 0
  assert pages.grow(1, 4) and pages.pages(1) == [5, 1] and pages.evictions == 1
  assert pages.lookup(a) == [0] and pages.cached == 1
  pages.release(1)
  with pytest.raises(ValueError, match="not cached"):
    pages.attach(1, [3])
  off = PageAllocator(num_pages=6, page_size=2, rows=2, pages_per_row=3)
  assert off.grow(0, 6) and off.register(0, a) == 0 and off.lookup(a) == []


def test_page_keys_chain_every_token_before_the_page_end():
  """Page j's key hashes page j − 1's key with its tokens (4-byte little-endian); asked again
  (the kept keys), the same keys, which a caller cannot change."""
  pages = PageAllocator(num_pages=8, page_size=3, rows=1, pages_per_row=8, prefix_cache=True)
  tokens = [5, 70000, 2, 9, 9, 1, 4]
  want, key = [], b""
  for j in range(2):
    page = b"".join(t.to_bytes(4, "little") for t in tokens[3 * j : 3 * j + 3])
    key = hashlib.blake2b(key + page).digest()
    want.append(key)
  got = pages.page_keys(tokens)
  assert got == want
  got.append(b"x")
  assert pages.page_keys(tokens) == want and pages.page_keys(np.asarray(tokens)) == want
  assert pages.page_keys(tokens[:5]) == want[:1] and pages.page_keys([9] + tokens[1:]) != want


def test_prefix_cache_config_is_checked(target):
  with pytest.raises(ConfigError, match="needs paged"):
    EngineConfig(prefix_cache=True)
  hybrid, _ = hf.load_config("jaxspec/assets/hybrid")
  why = prefix_lib.why_uncacheable(hybrid, 64, "float", 8)
  assert why is not None and "pages cannot hold" in why
  assert prefix_lib.why_uncacheable(target.config, 64, "float", 8) is None
  with pytest.raises(ConfigError, match="prefix_cache"):
    SpecEngine(
      jaxspec.load_model("jaxspec/assets/hybrid"),
      None,
      EngineConfig(max_len=64, page_size=8, prefix_cache=True),
    )
