"""Serving from paged K/V: rows hold pages of one pool, not max_len slots each.

64 requests of mixed lengths arrive at once at a 64-row server whose pool holds an eighth of
64 × max_len positions: the scheduler admits by free pages, grows rows page by page and
preempts the newest rows when the pool runs out. Every request must still equal the engine's
own output (greedy ones; sampled ones that were never preempted draw exactly what they draw
alone), preemption must happen and be counted, and nothing may compile while serving.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxspec.errors import ConfigError, InputError
from jaxspec.serve import SamplingOptions, Scheduler
from jaxspec.serve import admission, handles
from jaxspec.serve.pages import PageAllocator
from jaxspec.speculative.engine import SpecEngine
from jaxspec.speculative.engine_config import EngineConfig

from tests import near_ties

ROWS, MAX_LEN, PAGE = 64, 128, 8


def _requests(target, n: int, seed: int = 0):
  """n (prompt ids, options): prompts of 3..47 tokens cut from real text, 8..71 new tokens,
  every fourth sampled."""
  rng = np.random.default_rng(seed)
  with open("jaxspec/serve/scheduler.py") as f:
    ids = target.tokenizer.encode(f.read())
  out = []
  for i in range(n):
    at, size = int(rng.integers(0, len(ids) - 64)), int(rng.integers(3, 48))
    sampled = i % 4 == 3
    options = SamplingOptions(
      max_tokens=int(rng.integers(8, 72)),
      temperature=0.8 if sampled else 0.0,
      seed=1000 + i,
    )
    out.append((ids[at : at + size], options))
  return out


@pytest.fixture(scope="module")
def burst(target, bundled_drafter):
  """An EAGLE-3 chain engine of 64 rows whose pool holds an eighth of what 64 contiguous rows
  reserve, the 64 requests, and what a contiguous engine generates for them."""
  drafter = bundled_drafter("eagle3")
  pages = ROWS * (MAX_LEN // PAGE) // 8
  config = EngineConfig(
    max_len=MAX_LEN, batch_size=ROWS, stream_every=2, page_size=PAGE, kv_pages=pages
  )
  engine = SpecEngine(target, drafter, config)
  assert engine.config.num_pages == pages
  requests = _requests(target, ROWS)
  reference = SpecEngine(target, drafter, EngineConfig(max_len=MAX_LEN, batch_size=ROWS))
  want = reference.generate(
    [ids for ids, _ in requests],
    max_new_tokens=[o.max_tokens for _, o in requests],
    temperature=[o.temperature for _, o in requests],
    seed=[o.seed for _, o in requests],
  ).tokens
  want = [w[:-1] if w and w[-1] in reference.stop_ids else w for w in want]
  return engine, requests, want


def _serve_burst(engine, requests, reserve):
  """The requests through one scheduler (one queue: the same admissions every run)."""
  scheduler = Scheduler(engine, max_queue=ROWS, admission_reserve=reserve)
  scheduler.start()
  try:
    compiled = engine.compile_counts()
    handles = scheduler.submit_many(requests)
    results = [h.result()[0] for h in handles]
    assert engine.compile_counts() == compiled  # nothing compiled while serving
    metrics = scheduler.metrics()
  finally:
    scheduler.shutdown(drain=False, timeout=60)
  assert metrics["kv_pages_used"] == 0  # every page came back
  assert sum(h.preemptions for h in handles) == metrics["preemptions_total"]
  return handles, results, metrics


def _check_outputs(target, requests, handles, results, want):
  """Greedy rows equal the engine's; sampled rows never preempted draw what they draw alone."""
  sampled = []
  for (ids, options), handle, tokens, expected in zip(requests, handles, results, want):
    if options.temperature == 0:
      if tokens != expected:  # equal up to a genuine near-tie (its check runs the target)
        near_ties.assert_greedy_match(target, [ids], [expected], [tokens])
    elif handle.preemptions == 0:  # its own key: the draws it makes alone
      sampled.append(tokens == expected)
    else:  # resumed with a seed of its own: still its length budget
      assert len(tokens) <= options.max_tokens
  # A draw whose uniform falls within float noise of a CDF boundary may flip between a
  # 64-row step and the reference (the contiguous server shows the same on these requests):
  # allow one such row in eight.
  assert len(sampled) >= 4 and sum(sampled) >= len(sampled) - max(1, len(sampled) // 8)


def test_paged_server_equals_the_engine_under_preemption(target, burst):
  engine, requests, want = burst
  with pytest.raises(ConfigError, match="page allocator"):
    engine.generate(["x"], max_new_tokens=2)  # a short pool cannot hold every row at max_len
  # No reserve: admission packs the pool and growth preempts.
  handles, results, metrics = _serve_burst(engine, requests, reserve=0.0)
  assert metrics["preemptions_total"] >= 1 and metrics["kv_pages"] == engine.config.num_pages
  _check_outputs(target, requests, handles, results, want)


def test_a_full_admission_reserve_never_preempts(target, burst):
  """admission_reserve=1 keeps every running request's pages to its end free: the burst's
  first 32 requests (which overfill the pool too) run with no preemption, and their outputs
  are the engine's."""
  engine, requests, want = burst
  handles, results, metrics = _serve_burst(engine, requests[:32], reserve=1.0)
  assert metrics["preemptions_total"] == 0 and metrics["admission_reserve"] == 1.0
  _check_outputs(target, requests[:32], handles, results, want[:32])
  with pytest.raises(InputError, match="admission_reserve"):
    Scheduler(engine, admission_reserve=1.5)
  assert admission.parse_admission_reserve("measured") is None
  assert admission.parse_admission_reserve("0.25") == 0.25
  with pytest.raises(ConfigError, match="share"):
    admission.parse_admission_reserve("all")


def test_a_measured_reserve_follows_what_finished_requests_used(burst):
  """The measured reserve starts full, moves an eighth of the way to each finished request's
  share of max_tokens used, and halfway back to full on a preemption; admission keeps that
  share of a row's way to its end."""
  # pylint: disable=protected-access
  engine, requests, _ = burst
  scheduler = Scheduler(engine)  # not started: its bookkeeping only
  assert scheduler._admission.reserve_ratio == 1.0
  ids, options = requests[0]
  handle = handles.RequestHandle(scheduler, ids, dataclasses.replace(options, max_tokens=40))
  end = len(ids) + 40 + engine.lookahead + 1
  assert scheduler._admission.kept(len(ids) + 1, handle) == end
  for slot, reason in ((0, "stop"), (1, "cancelled")):  # a cancelled request tells nothing
    scheduler._active[slot] = handles.Slot(handle, 0, len(ids), len(ids) + 1)
    handle.generated = [7] * 10  # a quarter of its max_tokens
    scheduler._release(slot, handles.Delta([], None, reason))
    assert scheduler._admission.reserve_ratio == pytest.approx(1.0 - 0.75 / 8)
  scheduler._admission.reserve_ratio = 0.5
  handle.generated = []
  far = scheduler._admission.kept(len(ids) + 1, handle)
  assert far == len(ids) + 1 + int(np.ceil(0.5 * (end - len(ids) - 1)))
  scheduler._active[2] = handles.Slot(handle, 0, len(ids), len(ids) + 1)
  scheduler._requeue([2])
  assert scheduler._admission.reserve_ratio == 0.75 and handle.preemptions == 1
  fixed = Scheduler(engine, admission_reserve=0.0)
  fixed._active[2] = handles.Slot(handle, 0, len(ids), len(ids) + 1)
  fixed._requeue([2])
  assert fixed._admission.reserve_ratio == 0.0  # a fixed reserve stays as set
  assert fixed._admission.kept(len(ids) + 1, handle) == len(ids) + 1  # nothing kept past its length


TREE = dict(max_len=96, batch_size=6, verify="tree", tree_budget=6)


@pytest.fixture(scope="module")
def tree_engine(target, bundled_drafter):
  """DFlash + DDTree with paged K/V (pages of 8, the full pool), compiled once."""
  drafter = bundled_drafter("dflash")
  return SpecEngine(target, drafter, EngineConfig(**TREE, page_size=PAGE))


def test_paged_generate_equals_contiguous_for_trees(target, tree_engine):
  prompts = ["def fib(n):\n", "class Stack:\n", "import os\nimport sys\n"]
  contiguous = SpecEngine(target, tree_engine.drafter, EngineConfig(**TREE))
  outs = [
    engine.generate(prompts, max_new_tokens=40, temperature=0.0)
    for engine in (contiguous, tree_engine)
  ]
  assert outs[0].tokens == outs[1].tokens
  np.testing.assert_allclose(
    np.concatenate(outs[0].logprobs), np.concatenate(outs[1].logprobs), atol=1e-5
  )


def test_n_choices_from_one_prefill_equal_their_seeds_single_runs(target, tree_engine):
  """n = 4 on a paged tree engine (DFlash + DDTree): one prefill (counted once), the choices
  share the prompt's full pages, and choice i equals the single request with its seed."""
  scheduler = Scheduler(tree_engine, max_queue=16)
  scheduler.start()
  try:
    ids = target.tokenizer.encode("class Stack:\n    def __init__(self):\n")
    options = SamplingOptions(max_tokens=24, temperature=0.9, seed=11)
    group = scheduler.submit_n(ids, options, 4)
    choices = [h.result()[0] for h in group]
    prefilled = scheduler.metrics()["prompt_tokens_prefilled_total"]
    assert prefilled == len(ids)  # one prefill for four rows
    singles = []
    for i in range(4):
      seed = handles.choice_seed(11, i)
      assert group[i].options.seed == seed
      one = SamplingOptions(max_tokens=24, temperature=0.9, seed=seed)
      singles.append(scheduler.submit(ids, one).result()[0])
    assert choices == singles and len({tuple(c) for c in choices}) > 1
    assert scheduler.metrics()["kv_pages_used"] == 0
    with pytest.raises(InputError, match="choices"):
      scheduler.submit_n(ids, options, 7)  # more choices than rows
  finally:
    scheduler.shutdown(drain=False, timeout=60)


def test_page_allocator():
  pages = PageAllocator(num_pages=6, page_size=4, rows=3, pages_per_row=4)
  assert pages.grow(0, 9) and pages.pages(0) == [0, 1, 2]  # 9 positions: 3 pages
  assert pages.grow(1, 4) and pages.pages(1) == [3]
  assert not pages.grow(2, 13) and pages.pages(2) == []  # 4 pages wanted, 2 free: none given
  assert pages.shortfall(0, 16) == 1 and pages.shortfall(0, 100) == 1  # at most a row of pages
  assert pages.release(0) == 3 and pages.free == 5
  assert pages.grow(2, 13) and pages.pages(2) == [0, 1, 2, 4]  # the lowest free ids first
  table = pages.table()
  assert table.shape == (3, 4) and table.dtype == np.int32
  np.testing.assert_array_equal(table, [[6, 6, 6, 6], [3, 6, 6, 6], [0, 1, 2, 4]])
  with pytest.raises(ConfigError):
    PageAllocator(num_pages=3, page_size=4, rows=2, pages_per_row=4)  # not one row
  # Shared prompt pages stay held until the last holder lets go.
  shared = PageAllocator(num_pages=8, page_size=4, rows=3, pages_per_row=4)
  assert shared.grow(0, 10) and shared.pages(0) == [0, 1, 2]
  shared.share(1, 0, 2)
  assert shared.grow(1, 10) and shared.pages(1) == [0, 1, 3]  # its own partial page
  assert shared.used == 4
  shared.release(0)
  assert shared.used == 3 and shared.free == 5  # pages 0 and 1 still held by row 1
  shared.release(1)
  assert shared.free == 8


def test_paging_config_is_checked(target):
  with pytest.raises(ConfigError, match="must divide max_len"):
    EngineConfig(max_len=100, page_size=8)
  with pytest.raises(ConfigError, match="cannot hold one row"):
    EngineConfig(max_len=128, page_size=8, kv_pages=15)
  with pytest.raises(ConfigError, match="kv_pages needs page_size"):
    EngineConfig(kv_pages=4)
  engine = SpecEngine(target, None, EngineConfig(max_len=32, batch_size=2, page_size=8))
  state = engine.empty_state()
  with pytest.raises(InputError, match="shape"):
    engine.set_page_table(state, np.zeros((2, 3), np.int32))
  with pytest.raises(InputError, match="page ids"):
    engine.set_page_table(state, np.full((2, 4), 9, np.int32))


def test_pallas_kernel_reads_pages(target, bundled_drafter):
  """attention_impl="pallas" on a paged engine: the kernel reads the pool through the page
  table in place (interpret mode on CPU) and generates what the XLA reader generates; pages
  it cannot read (not a power of two ≥ 16 slots) are refused with the reason."""
  drafter = bundled_drafter("eagle3")
  ids = target.tokenizer.encode("def fib(n):\n    if n < 2:\n        return n\n")
  prompts, config = [ids, ids[:9]], EngineConfig(max_len=64, batch_size=2, page_size=16)
  outputs = [
    SpecEngine(target.with_options(attention_impl=impl), drafter, config)
    .generate(prompts, max_new_tokens=8, temperature=0.0)
    .tokens
    for impl in ("xla", "pallas")
  ]
  assert outputs[0] == outputs[1]
  small = dataclasses.replace(config, page_size=8)
  engine = SpecEngine(target.with_options(attention_impl="pallas"), drafter, small)
  with pytest.raises(ConfigError, match="pages of 8 slots"):
    engine.generate(prompts, max_new_tokens=2)
